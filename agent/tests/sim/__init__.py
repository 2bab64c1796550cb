"""A deterministic simulation of the work path: the real elector, queue consumer, Pod executor and
control-plane store, wired to fakes of the API server and the control plane's transport, on one
virtual clock and one seeded random source. `make sim SEEDS=N` runs many seeds; `make sim SEED=N`
replays one with its trace. See world.py (the world and its faults) and scenario.py (a run and its
invariants)."""
