"""The methods' pure math: torch functions and modules, one file per method, no FLARE, no I/O (see METHODS.md here)."""
