"""Will the job fit its GPUs? `marlaas plan CONFIG` (command.py) estimates each rank's device memory from the
model's config.json (estimate.py); the GPU dry run (dry_run.py) runs one trainer rank's GPU path on fake CUDA
tensors (fake_cuda.py) and measures it. Nothing here imports torch at import time: the dry run must load its
CUDA shim before torch."""
