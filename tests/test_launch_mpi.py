"""The MPI local mode runs on (launch/mpi.py): the fault-tolerant Open MPI 5 (ULFM) that tools/setup_env.sh installs
under the venv, chosen explicitly for every rank (MPI4PY_LIBMPI), or the system's mpirun; and each rank's own
verdict on whether its MPI survives a peer's death."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marlaas_hpc.config import JobConfig
from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.launch.mpi import (ULFM_DIR, FaultConfig, LocalMpi, fault_tolerance_missing, find_local_mpi,
                                    ulfm_prefix)

ROOT = Path(__file__).resolve().parents[1]


def _fake_install(root: Path) -> Path:
    prefix = root / ULFM_DIR
    (prefix / "bin").mkdir(parents=True)
    (prefix / "lib").mkdir()
    (prefix / "bin" / "mpiexec").write_text("#!/bin/sh\n")
    (prefix / "lib" / "libmpi.so.40").write_text("")
    return prefix


def test_auto_takes_the_ulfm_install_under_the_venv_and_names_its_libmpi(tmp_path):
    prefix = _fake_install(tmp_path)
    mpi = find_local_mpi("auto", environ={"PATH": "/usr/bin"}, venv=tmp_path)
    assert mpi.kind == "ulfm" and mpi.fault_tolerant and mpi.prefix == prefix
    args = mpi.launch_args(5)
    assert args[:3] == [str(prefix / "bin" / "mpiexec"), "-np", "5"]
    assert args[args.index("--with-ft") + 1] == "ulfm"
    assert args[args.index("mpi_ft_detector") + 1] == "false"
    env = mpi.environ({"PATH": "/usr/bin", "MPI4PY_LIBMPI": "/elsewhere/libmpi.so"})
    assert env["MPI4PY_LIBMPI"] == str(prefix / "lib" / "libmpi.so.40")
    assert env["OPAL_PREFIX"] == env["PRTE_PREFIX"] == env["PMIX_PREFIX"] == str(prefix)
    assert env["PATH"].split(os.pathsep)[0] == str(prefix / "bin")


def test_system_mpi_drops_a_leftover_libmpi_choice(tmp_path):
    _fake_install(tmp_path)
    (tmp_path / "bin").mkdir()
    mpirun = tmp_path / "bin" / "mpirun"
    mpirun.write_text("#!/bin/sh\n")
    mpirun.chmod(0o755)
    mpi = find_local_mpi("system", environ={"PATH": str(tmp_path / "bin")}, venv=tmp_path)
    assert mpi == LocalMpi(kind="system", mpiexec=str(mpirun)) and not mpi.fault_tolerant
    assert "--with-ft" not in mpi.launch_args(3)
    assert "MPI4PY_LIBMPI" not in mpi.environ({"MPI4PY_LIBMPI": "/x/libmpi.so.40"})


def test_ulfm_asked_for_but_missing_names_the_field(tmp_path):
    with pytest.raises(SpecError) as info:
        find_local_mpi("ulfm", environ={"PATH": ""}, venv=tmp_path)
    assert info.value.field == "fault.local_mpi" and "setup_env.sh" in str(info.value)
    assert ulfm_prefix({"MARLAAS_ULFM_PREFIX": str(_fake_install(tmp_path / "x"))}, venv=tmp_path) is not None


@pytest.mark.parametrize("version, environ, why", [
    ("Open MPI v4.1.4, package: Debian OpenMPI", {"OMPI_MCA_mpi_ft_enable": "1"}, "no fault tolerance"),
    ("Open MPI v5.0.11, package: Open MPI user@localhost", {}, "without fault tolerance"),
    ("MPICH Version:      4.2.0", {}, "not an Open MPI with ULFM"),
    ("Open MPI v5.0.11, package: Open MPI user@localhost", {"OMPI_MCA_mpi_ft_enable": "1"}, None),
])
def test_a_rank_knows_whether_its_mpi_survives_a_peer(version, environ, why):
    found = fault_tolerance_missing(version, environ)
    assert found is None if why is None else why in found


@pytest.mark.parametrize("section, field", [
    ({"on_rank_loss": "ignore"}, "fault.on_rank_loss"),
    ({"hang_timeout_s": -1}, "fault.hang_timeout_s"),
    ({"local_mpi": "mpich"}, "fault.local_mpi"),
])
def test_bad_fault_settings_are_refused_by_field(section, field):
    with pytest.raises(SpecError) as info:
        JobConfig.from_dict({"fault": section}).validate()
    assert info.value.field == field
    assert FaultConfig().validate().on_rank_loss == "continue"


PROBE = """
import os, signal, sys, time
from mpi4py import MPI
from marlaas_hpc.launch.mpi import fault_tolerance_missing
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
why = fault_tolerance_missing(MPI.Get_library_version(), os.environ)
comm.Barrier()
if why is None and rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
if why is None and rank == 1:
    try:
        comm.recv(source=2, tag=5)
    except MPI.Exception as exc:
        print("peer lost:", exc.Get_error_class() == MPI.ERR_PROC_FAILED, flush=True)
if rank == 0:
    print("library:", MPI.Get_library_version().split(",")[0], "| missing:", why, flush=True)
if why is None:
    comm.Ack_failed()
    comm.Shrink().Barrier()
MPI.Finalize()
os._exit(0)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("choice", ["ulfm", "system"])
def test_each_rank_loads_the_chosen_mpi_and_only_ulfm_survives_a_sigkill(tmp_path, choice):
    if choice == "ulfm" and ulfm_prefix() is None:
        pytest.skip("the ULFM Open MPI is not installed under the venv (tools/setup_env.sh)")
    mpi = find_local_mpi(choice)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = mpi.environ(dict(os.environ, PYTHONPATH=str(ROOT), OMPI_ALLOW_RUN_AS_ROOT="1",
                           OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    proc = subprocess.run([*mpi.launch_args(3), sys.executable, str(probe)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    if choice == "ulfm":
        assert "library: Open MPI v5" in proc.stdout and "missing: None" in proc.stdout
        assert "peer lost: True" in proc.stdout, "rank 1's recv from the killed rank 2 raised ERR_PROC_FAILED"
    else:
        assert "library: Open MPI v4" in proc.stdout and "has no fault tolerance" in proc.stdout
