/* Tells launcher / MPI-library problems apart from Python ones: every rank must see the expected world
 * size (argv[1]) and an allreduce of the ranks must give n(n-1)/2. Exit 0 only if all of that holds. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int expected = argc > 1 ? atoi(argv[1]) : size;
    if (size != expected) {
        fprintf(stderr, "mpi_probe: rank %d sees world size %d, expected %d "
                        "(wrong mpiexec for this MPI library? singletons?)\n", rank, size, expected);
        MPI_Finalize();
        return 2;
    }
    long mine = rank, total = 0;
    MPI_Allreduce(&mine, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    int ok = total == (long)size * (size - 1) / 2;
    if (rank == 0) printf("mpi_probe: world %d, allreduce %s\n", size, ok ? "ok" : "WRONG");
    MPI_Finalize();
    return ok ? 0 : 3;
}
