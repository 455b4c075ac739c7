"""Rule files, where names live: how they are found (files: shipped in reshard/layouts/<kind>/ or given as a path)
and the name rules of `--names` (module_names for the modules a live load fills, export_names for an exported file)."""
