# sglang-deploy — the two commands that matter:
#   make demo   set up what is missing, start the local lab, deploy to it
#   make test   every test: lint, pytest (unit + lab end-to-end), molecule
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV     := .venv
BIN      := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export ANSIBLE_FORCE_COLOR ?= 0
export PY_COLORS ?= 0
LAB_NODES ?= 2
LAB_GPUS  ?= 8
PYTEST_ARGS ?=
MOLECULE ?= molecule
# Line coverage of plugins/module_utils/, plugins/modules/, driver/ and plugins/filter/ (.coveragerc: subprocess runs included),
# printed by `make test`; each of those files must stay at 80 % or more (issue #17, tools/coverage_floor.py),
# the restart state machine at 90 % or more (issue #10).
COV := --cov --cov-report=term
COV_FLOOR := 80
# The state machine's files (sglang_deploy/restart.py says which part each holds).
STATE_MACHINE := failure.py machine.py phases.py restart.py operate.py
comma := ,
space := $(subst ,, )

.PHONY: help setup doctor image lab-up lab-down lab-status demo test test-lab test-rest coverage-floor lint lint-only pytest unit e2e molecule upgrade-check lock lock-sglang mutate mutate-ci ee-context clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

setup: ## install missing system packages and the pinned controller virtualenv, then the self-check
	@lab/bin/setup-host
	@lab/bin/doctor --setup

doctor: ## check each part the lab relies on (podman, runc, network, debootstrap, ssh, .venv)
	@lab/bin/doctor

image: setup ## build the lab node image once (debootstrap + podman import; FORCE=1 rebuilds)
	@lab/image/build.sh

lab-up: image ## start LAB_NODES lab nodes (default 2) with LAB_GPUS simulated GPUs each (default 8)
	@$(BIN)/python lab/lab.py up --nodes $(LAB_NODES) --gpus $(LAB_GPUS)

lab-down: ## remove every lab container, the lab network, inventory and key
	@if [ -x $(BIN)/python ]; then $(BIN)/python lab/lab.py down; else python3 lab/lab.py down; fi

lab-status: ## list lab containers
	@$(BIN)/python lab/lab.py status

demo: lab-up ## the main job on the local lab: deploy, safe restart and verify, through the driver
	@$(BIN)/python -m driver deploy
	@$(BIN)/python -m driver restart
	@$(BIN)/python -m driver verify

lint: setup lint-only ## ruff (lint and format), yamllint, ansible-lint (production profile), promtool on the alert rules, the modules' sanity

# The linters alone, on the virtualenv as it is (make test's rest stream: no setup's self-check beside a lab).
# promtool (Debian 12's, in .venv/bin): the monitoring role's rules and their unit tests (issue #34); the
# configuration it writes is checked by tests/test_monitoring.py, which renders it for the example inventory.
# tools/sanity.py: ansible-test's sanity tests on plugins/modules/ as the collection sglang.deploy, and ansible-doc of each
# module and each filter (issue #33; about 15 s, its first run about a minute: it builds ansible-test's virtualenvs).
lint-only:
	@ruff check .
	@ruff format --check .
	@yamllint --strict .
	@ansible-lint --profile production
	@promtool check rules --lint-fatal roles/sglang_monitoring/files/sglang-deploy.rules.yml
	@promtool test rules tests/promtool/sglang-deploy.rules.test.yml
	@$(BIN)/python tools/sanity.py

unit: setup ## pytest without the lab
	@$(BIN)/python -m pytest -m "not lab" $(PYTEST_ARGS)

e2e: image ## pytest end-to-end tests on their own lab nodes
	@$(BIN)/python -m pytest -m lab $(PYTEST_ARGS)

pytest: image ## every pytest test in one run, with line coverage (each production file at least 80 %, the state machine 90 %)
	@$(BIN)/python -m pytest $(COV) $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory coverage-floor

coverage-floor: ## the floors over the last run's .coverage (each production file 80 %, the state machine 90 %)
	@$(BIN)/python -m coverage report --include='plugins/module_utils/sglang_deploy/$(subst $(space),$(comma)plugins/module_utils/sglang_deploy/,$(STATE_MACHINE))' --fail-under=90
	@$(BIN)/python -m coverage json -q -o - | $(BIN)/python tools/coverage_floor.py --floor $(COV_FLOOR) -

molecule: image ## every molecule scenario (create, converge, idempotence, check, verify, destroy)
	@$(MOLECULE) test --all

# make test runs two streams side by side (CI has 2 cores): the lab's end-to-end tests; the lint, the unit tests,
# molecule, then the end-to-end tests of E2E_REST on a lab of their own. The lab stream waits on servers, SSH and
# systemd about half its time, and was the longer by far: the rest stream takes the modules below once molecule is
# done, which would otherwise leave a core idle. Their containers (labels, names), networks and ports never meet.
# Each line is prefixed with its stream; the unit tests' coverage is held to the floors. Each
# e2e run's every test time is in .lab-tests/{lab,rest}.xml (JUnit XML), to balance the streams by.
E2E_REST := tests/e2e/test_collection.py tests/e2e/test_tune.py tests/e2e/test_rollout_groups.py tests/e2e/test_restart_multinode.py tests/e2e/test_durability.py tests/e2e/test_secrets.py
# The floors are judged on the unit tests' coverage (alone 97 %, every file over 85 %). The end-to-end runs are
# not measured unless E2E_COV=--cov: coverage follows every ansible-playbook they start (.coveragerc's subprocess
# patch), which costs the controller about half as much CPU again on a 2-core machine that both streams fill.
E2E_COV :=
test: ## every test: (lint, unit tests, molecule, E2E_REST) beside the other lab tests, then the coverage floors
	@rm -f .coverage .coverage.lab .coverage.lab-rest .coverage.unit
	@$(MAKE) --no-print-directory -j2 test-lab test-rest
	@$(BIN)/python -m coverage combine -q $(if $(E2E_COV),.coverage.lab .coverage.lab-rest) .coverage.unit
	@$(BIN)/python -m coverage report --format=total | sed 's/^/line coverage ($(if $(E2E_COV),both streams,the unit tests)): /; s/$$/ %/'
	@$(MAKE) --no-print-directory coverage-floor

# Each stream ends with its recap (the random order's seed, each failed or erroring test), so the last lines of
# a failed CI run name what to run again: pytest --randomly-seed=N <the test>.
RECAP = grep -E '^(lab  |rest )\| (Using --randomly-seed=|(FAILED|ERROR) tests/|lint failed)' $(1) | sed 's/^\(.....\)| /\1| recap: /' || true

test-lab: image
	@mkdir -p .lab-tests; SECONDS=0; COVERAGE_FILE=$(CURDIR)/.coverage.lab $(BIN)/python -m pytest -m lab $(E2E_COV) \
		$(if $(E2E_COV),--cov-report=) --junitxml=.lab-tests/lab.xml $(foreach f,$(E2E_REST),--ignore=$(f)) $(PYTEST_ARGS) 2>&1 | sed -u 's/^/lab  | /' | tee .lab-tests/lab-stream.log \
		|| rc=$$?; $(call RECAP,.lab-tests/lab-stream.log); echo "lab  | stream took $${SECONDS}s, exit $${rc:-0}"; exit $${rc:-0}

test-rest: image
	@mkdir -p .lab-tests; SECONDS=0; { { $(MAKE) --no-print-directory lint-only || { echo "lint failed"; false; }; } \
		&& COVERAGE_FILE=$(CURDIR)/.coverage.unit $(BIN)/python -m pytest -m "not lab" --cov --cov-report= $(PYTEST_ARGS) \
		&& $(BIN)/python tools/mutate.py --ci \
		&& $(MOLECULE) test --all \
		&& SGD_E2E_LAB=sgd-e2e-rest COVERAGE_FILE=$(CURDIR)/.coverage.lab-rest $(BIN)/python -m pytest -m lab $(E2E_COV) \
			$(if $(E2E_COV),--cov-report=) --junitxml=.lab-tests/rest.xml $(PYTEST_ARGS) $(E2E_REST); } 2>&1 | sed -u 's/^/rest | /' | tee .lab-tests/rest-stream.log \
		|| rc=$$?; $(call RECAP,.lab-tests/rest-stream.log); echo "rest | stream took $${SECONDS}s, exit $${rc:-0}"; exit $${rc:-0}

# Mutation testing (issue #31; not part of make test: its time is in docs/testing.md). MUTATE_FILES narrows it to
# some of tools/mutate.py's SCOPE (sglang_deploy/known_good.py ...); results in docs/bench/mutation.json.
mutate: setup ## mutmut over the operations core: killed, survived and the score per file (MUTATE_FILES=...)
	@$(BIN)/python tools/mutate.py $(if $(MUTATE_FILES),--files $(MUTATE_FILES))

mutate-ci: ## make test's subset: the mutants of the core functions changed since docs/bench/mutation.json
	@$(BIN)/python tools/mutate.py --ci

ee-context: setup ## the execution environment's build context in .ee/context (then: ansible-builder build -c .ee/context)
	@rm -rf .ee && $(BIN)/ansible-galaxy collection build --output-path .ee/dist . >/dev/null
	@$(BIN)/ansible-builder create -f execution-environment.yml -c .ee/context

upgrade-check: setup ## does the patch series apply to SGLANG_CANDIDATE? (fetches its wheel, changes nothing)
	@test -n "$(SGLANG_CANDIDATE)" || { echo "usage: make upgrade-check SGLANG_CANDIDATE=X.Y.Z" >&2; exit 2; }
	@ansible-playbook playbooks/upgrade-check.yml -e sglang_candidate_version=$(SGLANG_CANDIDATE)

lock-sglang: setup ## SGLang's complete lock with hashes: SGLANG_VERSION=x.y.z PROFILE=full|parser [PYTHON_VERSION= PLATFORM=]
	@test -n "$(SGLANG_VERSION)" || { echo "usage: make lock-sglang SGLANG_VERSION=x.y.z PROFILE=full|parser [PYTHON_VERSION=3.11 PLATFORM=manylinux_2_34_x86_64]" >&2; exit 2; }
	@$(BIN)/python tools/lock_sglang.py --sglang-version $(SGLANG_VERSION) --profile $(or $(PROFILE),full) \
		--python-version $(or $(PYTHON_VERSION),3.11) --platform $(or $(PLATFORM),manylinux_2_34_x86_64)

lock: ## refresh requirements.lock from requirements.in
	@$(BIN)/python -m pip install -q -r requirements.in
	@$(BIN)/python -m pip freeze --exclude-editable >requirements.lock

clean: lab-down ## lab down, and remove the virtualenv
	@rm -rf $(VENV) .pytest_cache .lab-tests .coverage .coverage.*
