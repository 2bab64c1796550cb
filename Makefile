# gpu-agent: the two commands a newcomer needs are `make run` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup wheels release release-oci run sim fuzz e2e-fast e2e-kind-podman e2e-split test test-unit test-integration lint bench bench-footprint bench-nodes bench-domain bench-queue bench-dra bench-fake-gpu gpu-check clean e2e chaos handover flaps mutate cluster-up cluster-down images node-stop node-start node-partition node-heal

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	@PYTHON=$(PYTHON) bash scripts/setup.sh
	@touch $@

## wheels: the project's wheels in build/wheels (what the image installs), stamped with commit and build date
wheels:
	bash scripts/build-wheels.sh

## release: package both charts into dist/ (with a Helm repo index), build the image tagged with the version, and
## record the version with its commit in releases.yaml; the tree must be clean
release: setup
	bash scripts/release.sh

## release-oci: `make release`, with both charts also signed (helm package --sign; a throwaway key unless
## RELEASE_SIGN_KEY, RELEASE_KEYRING and RELEASE_PUBRING name yours), verified, pushed to oci://REGISTRY/charts and
## read back (scripts/release-oci.sh). REGISTRY=HOST[:PORT]; REGISTRY_CA and REGISTRY_CREDENTIALS as
## `eval "$$(ci/scripts/registry.sh env)"` sets them for the CI's registry
release-oci: setup
	@test -n "$(REGISTRY)" || { echo "make release-oci needs REGISTRY=HOST[:PORT] (the chart goes to oci://HOST/charts)" >&2; exit 2; }
	RELEASE_REGISTRY=$(REGISTRY) bash scripts/release.sh

## run: the control plane + cluster agent with fake GPUs on loopback (no cluster needed)
ARGS ?=
run: setup
	$(BIN)/gpu-agent local $(ARGS)

## test: every test, stage by stage (scripts/test.sh): the tools the unit stage needs, lint, unit, integration, then
## the e2e suite (each test once: the `fast` ones on a 2-node kind cluster through podman, the rest on the 3-node CI
## cluster; needs root); at the end a report of where the time went, the slowest tests and any skipped test. Fails on
## any skip and when the run passes TEST_BUDGET_MINUTES (80; CI stops a run at 90)
test: setup
	BIN=$(abspath $(BIN)) TEST_JOBS=$(TEST_JOBS) bash scripts/test.sh

## e2e-split: the e2e part of `make test`: every e2e test once, but those marked `every_cluster` (a user's first
## install) on both. The CI cluster runs all but the `fast` ones (`make e2e` alone runs them all); the kind stage
## (e2e-kind-podman) runs the `fast` ones, so that `make e2e CLUSTER=kind` is proven on every run.
e2e-split: setup
	$(MAKE) -C ci e2e CLUSTER=ci PYTEST=$(abspath $(BIN)/pytest) PYTEST_ARGS="-m 'not fast or every_cluster'"
	$(MAKE) -C ci kind-stage PYTEST=$(abspath $(BIN)/pytest)

## lint: the layers (import-linter), ruff over every Python file and mypy --strict over the three packages (both
## configured in pyproject.toml), and every relative link of the Markdown files landing inside the repository
## (scripts/check-doc-links.py: a file, a heading for #anchor; no citation of a file the repository lacks), and the
## runtime's rules (scripts/check-runtime-rules.py: every API call names its timeout; no thread outside its owner)
lint: setup
	$(BIN)/lint-imports
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python scripts/check-doc-links.py
	$(BIN)/python scripts/check-runtime-rules.py

## test-unit / test-integration: on TEST_JOBS workers (pytest-xdist; default auto, one per core; 0 runs in-process)
TEST_JOBS ?= auto
test-unit: setup
	$(BIN)/pytest -n $(TEST_JOBS) agent/tests/unit fake-gpu/tests hooks/tests ci/tests charts/tests


test-integration: setup
	$(BIN)/pytest -n $(TEST_JOBS) agent/tests/integration

## e2e: CLUSTER=ci (default: brings the CI cluster up, runs the suite, tears it down) | existing | kind | k3d
CLUSTER ?= ci
e2e: setup
	$(MAKE) -C ci e2e CLUSTER=$(CLUSTER) PYTEST=$(abspath $(BIN)/pytest)

## e2e-kind-podman: the kind stage of the test command (ci/scripts/kind-stage.sh): podman, kind from the Go
## module proxy and a kind node image assembled here; a 2-node kind cluster through `make e2e CLUSTER=kind`,
## the `fast` tests, the cluster deleted, the host checked unchanged. PYTEST_ARGS="..." for other tests.
e2e-kind-podman: setup
	$(MAKE) -C ci kind-stage PYTEST=$(abspath $(BIN)/pytest)

## e2e-fast: install, GPU basic and readiness only (marker `fast`); KEEP_CLUSTER=1 keeps the cluster for the next run
e2e-fast: setup
	$(MAKE) -C ci e2e CLUSTER=$(CLUSTER) PYTEST=$(abspath $(BIN)/pytest) PYTEST_ARGS="-m fast"

# One e2e test as a benchmark on the CI cluster, in one process (under xdist, -s loses what it prints).
e2e_benchmark = $(MAKE) -C ci e2e CLUSTER=$(CLUSTER) PYTEST=$(abspath $(BIN)/pytest) PYTEST_ARGS="-s -k $(1)" E2E_JOBS=0

## handover: N graceful deletes of the leading cluster agent beside a hot standby, each with an item in flight, on the
## CI cluster: per hand-over when the Lease was released and taken and when an agent leased again, the slowest one's
## shutdown log. A benchmark: `make handover N=50` (the test command runs 2).
handover: setup
	E2E_HANDOVERS=$(or $(N),50) $(call e2e_benchmark,graceful_hand_overs)

## flaps: N leadership flaps (the leader cut off the API server until its standby leads, then let back) on the CI
## cluster: each agent's threads and RSS before and after, read from /proc on the host. A benchmark: `make flaps N=20`
## (the test command runs 2).
flaps: setup
	E2E_FLAPS=$(or $(N),20) $(call e2e_benchmark,leadership_flaps)

## chaos: K random disruptions (leader force-deleted, deleted, killed; standby deleted; control plane restarted; node
## agents force-deleted or stopped) under a stream of work on the CI cluster, then a table: items, lost, doubled, most
## active leaders seen, worst time back to Ready. A benchmark: `make chaos K=50` (the test command runs K=5).
K ?= 50
chaos: setup
	CHAOS_K=$(K) $(call e2e_benchmark,chaos)

## cluster-up NODES=3 | cluster-down | images | node-stop/node-start/node-partition/node-heal NODE=w1: see ci/Makefile
cluster-up cluster-down images node-stop node-start node-partition node-heal:
	$(MAKE) -C ci $@

## sim: the deterministic simulation of the work path (agent/tests/sim): SEEDS=N seeds from FIRST (default 100000),
## or SEED=N to replay one with its trace; ARGS=--no-fencing runs it without the admission policy that fences work Pods
SEEDS ?= 100000
FIRST ?= 1
sim: setup
	cd agent && ../$(BIN)/python -m tests.sim $(if $(SEED),--seed $(SEED),--seeds $(SEEDS) --first $(FIRST)) $(ARGS)

## mutate: mutation testing of the core mechanisms (scripts/mutate.py, mutmut): every small change mutmut makes to
## agent/gpu_agent/mechanisms/{registration,queues,leadership,domain,inventory} is read by mypy, then run against the
## unit tests that reach it; a table per file (mutants, killed, by mypy, survived, timeout, justified, score) and the
## survivors (file:line, the change). Fails while a survivor is neither killed nor justified in
## agent/tests/mutation-survivors.toml. Long: 8,637 mutants, about 1.5 h on one worker (estimated; leadership's 842
## took 7 min): MODULE=leadership or a file limits it, MUTATE_JOBS=N runs N at once (default 1); ARGS=--retest
## reruns the last run's survivors only, ARGS=--count counts without running, ARGS=--stubs prints list entries
MUTATE_JOBS ?= 1
mutate: setup $(VENV)/.mutate-installed
	nice -n 19 $(BIN)/python scripts/mutate.py $(if $(MODULE),--module $(MODULE)) --jobs $(MUTATE_JOBS) $(ARGS)

$(VENV)/.mutate-installed: pyproject.toml
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install --quiet -e '.[mutate]'
	@touch $@

## fuzz: the longer fuzzing run (schemathesis on the control plane, hypothesis on every parsed file)
FUZZ_EXAMPLES ?= 1000
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -s agent/tests/unit/test_parsers_fuzz.py agent/tests/integration/test_fuzz_control_plane.py

## bench: GPU arrival/removal latency, RSS and idle CPU of a local agent, then each role's RSS and idle CPU in its
## chart configuration on the CI cluster (printed, not asserted)
bench: setup
	PYTHONPATH=agent $(BIN)/python agent/bench/bench_agent.py
	$(MAKE) bench-footprint

## bench-footprint: each role's RSS and idle CPU in its chart configuration, on the CI cluster (brought up, images built)
bench-footprint: setup
	$(MAKE) -C ci cluster-up images
	$(BIN)/python agent/bench/bench_footprint.py

## bench-nodes: the CI cluster with 3 nodes (brought up), then each worker's idle RSS and CPU (printed, not asserted)
bench-nodes:
	$(MAKE) -C ci cluster-up NODES=3
	python3 ci/tools/node_footprint.py

## bench-domain: N simulated node agents on one GPUDomain on the CI cluster, per write strategy, then the simulator
bench-domain: setup
	$(MAKE) -C ci cluster-up
	PYTHONPATH=agent:. $(BIN)/python agent/bench/bench_domain.py

## bench-queue: the control plane alone on loopback (lease+ack/s, 1/4/16 consumers), then on the CI cluster (brought up,
## images built) 300 one-GPU items through the chart's cluster agent against a plain client's floor (printed, not
## asserted; BENCH_RUNS=3 runs, BENCH_CP_ONLY=1: the loopback part only)
bench-queue: setup
	$(if $(BENCH_CP_ONLY),,$(MAKE) -C ci cluster-up images)
	PYTHONPATH=agent:. $(BIN)/python agent/bench/bench_queue.py

## bench-dra: on the CI cluster (brought up, images built), one-GPU pods create -> Running through DRA and through the
## device plugin in the same run (median and p99 of BENCH_PODS=20 each), and fake GPUs 0 -> 2 -> the devices in the
## node's ResourceSlice (BENCH_ARRIVALS=10); printed, not asserted
bench-dra: setup
	$(MAKE) -C ci cluster-up images
	PYTHONPATH=agent:agent/bench $(BIN)/python agent/bench/bench_dra.py

## bench-fake-gpu: one node's fake GPUs through layout, state file and device plugin (ListAndWatch, Allocate), 64 to
## 81,920 GPUs a node, and what breaks first (printed, not asserted; no cluster needed; BENCH_COUNTS=1024,4096)
bench-fake-gpu: setup
	PYTHONPATH=agent:fake-gpu $(BIN)/python agent/bench/bench_fake_gpu_node.py

## gpu-check: on a machine with an NVIDIA GPU, NVML inventory vs nvidia-smi, health and events (3 s wait), then /healthz
gpu-check:
	bash scripts/gpu-check.sh

clean:
	rm -rf $(VENV) .run .pytest_cache .mutate
