"""The parts of the prepared GPU check (`scripts/gpu_all.sh`): one module a part, each run as its own process
(`python3 -m scripts.gpu_parts.NAME OUT [--smoke] [--budget-s S]`) so a part that overruns is cut alone."""
