"""Every device-dependent choice, made once at start-up: the platform policy (`policy`), how it picks the attention
backend (`attention_choice`) and measures the matmul routes on this machine (`kernel_choice` for a CPU,
`gpu_matmul_choice` for a GPU), and the device facts the rest may read (`devices`)."""
