"""The commands on one checkpoint: inspect, validate (and the proof of completeness), plan, convert, export, diff.
Each module does one command and returns its typed result; reshard.api binds them to the public functions and
reshard.cli prints them."""
