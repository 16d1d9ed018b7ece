"""marlaas_hpc."""
