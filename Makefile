# slipway: build the training image, launch it across Slurm nodes.
# Every target runs from the project's own virtual environment (.venv).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CONFIG ?= tiny_cpu
ARGS   ?=
NODES  ?= 2
STAMP  := $(VENV)/.installed
# Which torch `make setup` installs first (CI pins the CPU build it carries), and which build of it:
# TORCH=cpu, from PyTorch's CPU index, where no NVIDIA GPU is visible; TORCH=cuda, PyPI's CUDA
# build, where one is. TORCH_INDEX= leaves the choice to pip's own indexes (a local wheelhouse, as
# CI's). Sizes on disk, measured in a new .venv (torch 2.13.0, Python 3.11, x86_64): the CPU build
# with what it pulls in (sympy, networkx, ...) 0.9 GB from a 0.19 GB download; the CUDA build's
# libraries are a download of about 3 GB (not measured on disk: no NVIDIA GPU where these were).
TORCH_SPEC ?= torch>=2.10,<2.14
TORCH ?= $(if $(or $(wildcard /proc/driver/nvidia/version),$(wildcard /dev/nvidia0)),cuda,cpu)
TORCH_INDEX ?= $(if $(filter cpu,$(TORCH)),https://download.pytorch.org/whl/cpu)
TORCH_SIZE := $(if $(filter cpu,$(TORCH)),0.9 GB on disk from a 0.2 GB download,a download of about 3 GB with its CUDA libraries)
# An index that does not answer (no DNS, a firewall) would cost pip minutes of retries: it gets
# this many seconds, name lookup included, before pip's own indexes serve torch instead.
TORCH_PROBE_SECONDS ?= 4

# The variables this Makefile reads. Any other given on make's command line would reach no recipe
# (`make local STEPS=50`, `make local train.steps=50`): refused, naming the form that passes it to
# slipway, ARGS. One door for slipway's settings, not a make variable for each of its flags.
KNOWN_VARIABLES := PYTHON CONFIG ARGS NODES TORCH TORCH_SPEC TORCH_INDEX TORCH_PROBE_SECONDS TEST_WORKERS \
                   OLDEST_TORCH BASE_IMAGE OUT WHEELS WHEELS_OUT PLATFORM PYTHON_VERSION HAVE PYXIS_SOURCES GPU_CHECK_VENV
GIVEN_UNKNOWN := $(strip $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(if $(filter $(v),$(KNOWN_VARIABLES)),,$(v)))))
ARGS_FORM = $(if $(findstring .,$(1)),$(1)=$($(1)),$(if $(filter STEPS,$(1)),--train-steps $($(1))))
GIVEN_FORM := $(strip $(ARGS) $(foreach v,$(GIVEN_UNKNOWN),$(call ARGS_FORM,$(v))))
ifneq ($(GIVEN_UNKNOWN),)
$(error $(foreach v,$(GIVEN_UNKNOWN),$(v)=$($(v))): make reads no such variable (make help lists those it does); slipway's settings go in ARGS (slipway local --help lists its flags): make $(or $(MAKECMDGOALS),local)$(if $(filter-out tiny_cpu,$(CONFIG)), CONFIG=$(CONFIG)) ARGS="$(or $(GIVEN_FORM),...)")
endif

.PHONY: help setup torch-index setup-oldest setup-oldest-torch prepare local lint test test-oldest test-gpu test-fast test-count submit dry-run shell image image-prune status doctor edf \
        cluster-up cluster-down bench clean pyxis

help:
	@echo "make local [CONFIG=tiny_cpu] [ARGS='--train-steps 50'] [TORCH=cpu|cuda]  train on this machine (no Slurm, no container)"
	@echo "make test                            every test (root for its own Slurm and podman; torch 2.10 too); pytest says its time"
	@echo "make lint                            ruff and vulture (make test runs it first)"
	@echo "make test-fast                       the quick tier: no Slurm, podman, training or test of over 20 s"
	@echo "make test-count                      how many tests each tier holds, counted now"
	@echo "make image [CONFIG=...] [BASE_IMAGE=...]  podman build + enroot import -> images/*.sqsh"
	@echo "make prepare CONFIG=tiny_wikitext [ARGS=--as-job]  tokenise the dataset before the allocation"
	@echo "make submit CONFIG=tiny_wikitext [ARGS='--nodes 2 train.steps=100']"
	@echo "make shell CONFIG=...                interactive srun --pty bash in the image"
	@echo "make status | doctor CONFIG=... | edf CONFIG=... | cluster-up | cluster-down | bench"
	@echo "make pyxis [PYXIS_SOURCES=DIR]       enroot + pyxis from their release sources into .pyxis/ (pytest -m pyxis)"
	@echo "make gpu-check [OUT=gpu-check] [WHEELS=DIR]   on a GPU node, offline, 10 min: does it train correctly and fast?"
	@echo "make gpu-check-wheels [PYTHON_VERSION=3.12] [PLATFORM=manylinux_2_28_x86_64] [HAVE=FILE]"

# pip's own Collecting / Downloading (size) / progress lines show what is being installed; each
# phase says first what comes, so a long download or unpack never looks like a hang.
PIP_INSTALL = -m pip install --progress-bar on --no-input

$(STAMP): pyproject.toml
	@echo "==> [1/4] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(PY) $(PIP_INSTALL) --quiet --upgrade pip
	@index=$$($(MAKE) -s --no-print-directory torch-index) || exit 1; \
	echo "==> [3/4] installing $(TORCH_SPEC), the $(TORCH) build$${index:+, from $$index}$${index:-, from pip's own indexes}: the"; \
	echo "    largest part ($(TORCH_SIZE); TORCH=$(if $(filter cpu,$(TORCH)),cuda,cpu) for the other build). pip then"; \
	echo "    unpacks it for a minute or two (a terminal shows pip's install bar, a log nothing until done)"; \
	echo "$(PY) $(PIP_INSTALL) $${index:+--index-url $$index }'$(TORCH_SPEC)'"; \
	$(PY) $(PIP_INSTALL) $${index:+--index-url "$$index"} '$(TORCH_SPEC)'
	@echo "==> [4/4] installing slipway (editable) with the trainer and test dependencies (datasets, tokenizers,"
	@echo "    transformers, matplotlib, pytest: 0.7 GB on disk from about 0.15 GB of downloads)"
	$(PY) $(PIP_INSTALL) -e '.[trainer,test]'
	touch $(STAMP)
	@echo "==> set up: $(VENV) (torch $$($(PY) -c 'from importlib.metadata import version; print(version("torch"))'))"

setup: $(STAMP)

# The index `make setup` installs torch from, on stdout: TORCH_INDEX where it answers within
# TORCH_PROBE_SECONDS, else none (pip's own indexes), said in one line on stderr.
torch-index:
	@if [ -z '$(TORCH_INDEX)' ]; then :; elif timeout $(TORCH_PROBE_SECONDS) $(PYTHON) -c 'import sys, urllib.request as u; \
	    u.urlopen(u.Request(sys.argv[1].rstrip("/") + "/torch/", method="HEAD"), timeout=60)' '$(TORCH_INDEX)' \
	    2>/dev/null; then echo '$(TORCH_INDEX)'; else echo "==> $(TORCH_INDEX) does not answer from here (a \
	$(TORCH_PROBE_SECONDS) s probe): torch comes from pip's own indexes instead; TORCH_INDEX=URL picks another index, \
	TORCH_INDEX= pip's own without the probe" >&2; fi

local: $(STAMP)
	$(PY) -m jobs local $(CONFIG) $(ARGS)

# Two pytest workers: the Slurm and podman tests (mostly waiting on jobs and builds) run beside
# the CPU-bound trainer tests (tests/conftest.py groups them); TEST_WORKERS=0 runs one process.
TEST_WORKERS ?= 2

# ruff and vulture, as pyproject.toml configures them: zero findings, or make stops here.
lint: $(STAMP)
	$(VENV)/bin/ruff check --quiet common jobs edf containers trainer tests bench
	$(VENV)/bin/vulture

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=25 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS)) $(ARGS)
	$(MAKE) test-oldest ARGS=

# The oldest torch the trainer supports (the NGC 25.12 image's 2.10), in a venv of its own:
# the trainer's layout, checkpoint and resume tests run there too, so both ends of the
# supported range are tested. The same build as `make setup`'s (TORCH): PyPI's 2.10 wheel carries
# the CUDA runtime (~3 GB, once), the CPU index's does not (~0.2 GB).
OLDEST_VENV  := .venv-oldest
OLDEST_PY    := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed
OLDEST_TORCH ?= torch==2.10.0
# The flagship's own 8-process run (tests/test_trainer_flagship.py, 2 minutes) stays on the newest
# torch only, for CI's time: its tp x dp layout with tied, padded embeddings runs here too, in
# the layout tests' small model.
OLDEST_TESTS := tests/test_trainer_model.py tests/test_trainer_parallel.py tests/test_trainer_checkpoint.py \
                tests/test_trainer_nonfinite.py

OLDEST_TORCH_STAMP := $(OLDEST_VENV)/.torch

# torch alone first: the long download, which CI runs while it installs the rest (.ci/run).
$(OLDEST_TORCH_STAMP):
	@echo "==> [1/3] creating the virtual environment $(OLDEST_VENV)"
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) $(PIP_INSTALL) --quiet --upgrade pip
	@index=$$($(MAKE) -s --no-print-directory torch-index) || exit 1; \
	echo "==> [2/3] installing $(OLDEST_TORCH), the $(TORCH) build$${index:+, from $$index}$${index:-, from pip's own indexes} ($(TORCH_SIZE), once);"; \
	echo "    pip then unpacks it for a few minutes (a terminal shows pip's install bar, a log nothing until done)"; \
	echo "$(OLDEST_PY) $(PIP_INSTALL) $${index:+--index-url $$index }'$(OLDEST_TORCH)'"; \
	$(OLDEST_PY) $(PIP_INSTALL) $${index:+--index-url "$$index"} '$(OLDEST_TORCH)'
	touch $(OLDEST_TORCH_STAMP)

$(OLDEST_STAMP): pyproject.toml $(OLDEST_TORCH_STAMP)
	@echo "==> [3/3] installing slipway (editable) with the trainer and test dependencies beside $(OLDEST_TORCH)"
	$(OLDEST_PY) $(PIP_INSTALL) -e '.[trainer,test]' '$(OLDEST_TORCH)'
	touch $(OLDEST_STAMP)

setup-oldest-torch: $(OLDEST_TORCH_STAMP)

setup-oldest: $(OLDEST_STAMP)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -c 'import torch; print("torch", torch.__version__)'
	$(OLDEST_PY) -m pytest -q -m "not slurm and not podman" $(OLDEST_TESTS) $(ARGS)

# One GPU (CUDA): bf16 against the fp32 CPU reference, flash-attn, NCCL; skips without CUDA.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/test_gpu.py $(ARGS)

# The tests that need no Slurm, podman or process group, on TEST_WORKERS workers: for the
# edit-test loop (`make test` runs every test). A test of more than 20 s is marked `slow` and left
# out; --durations names the slowest, so one that grows is seen where it grows. Its measured time:
# docs/development.md#tests.
test-fast: $(STAMP)
	$(PY) -m pytest -q --durations=10 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS)) \
	    -m "not slurm and not podman and not multiproc and not slow" $(ARGS)

# The tiers' sizes, counted now by pytest's collection (the figures no document keeps).
test-count: $(STAMP)
	@$(PY) -m pytest -q --collect-only -m "not slurm and not podman and not multiproc and not slow" | tail -1 \
	    | sed 's/^/make test-fast: /'
	@$(PY) -m pytest -q --collect-only | tail -1 | sed 's/^/make test:      /'

submit: $(STAMP)
	$(PY) -m jobs submit $(CONFIG) $(ARGS)

prepare: $(STAMP)
	$(PY) -m jobs prepare $(CONFIG) $(ARGS)

dry-run: $(STAMP)
	$(PY) -m jobs submit $(CONFIG) --dry-run $(ARGS)

shell: $(STAMP)
	$(PY) -m jobs shell $(CONFIG) $(ARGS)

image: $(STAMP)
	$(PY) -m jobs image build $(CONFIG) $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(ARGS)

image-prune: $(STAMP)
	$(PY) -m jobs image prune $(CONFIG) $(ARGS)

status: $(STAMP)
	$(PY) -m jobs status $(ARGS)

doctor: $(STAMP)
	$(PY) -m jobs doctor $(CONFIG) $(ARGS)

edf: $(STAMP)
	$(PY) -m jobs edf $(CONFIG) $(ARGS)

# A real Slurm cluster of $(NODES) nodes on this machine (root; Debian slurm-wlm + munge).
cluster-up: $(STAMP)
	$(PY) -m jobs cluster up --nodes $(NODES)

cluster-down: $(STAMP)
	$(PY) -m jobs cluster down

# The real container runtime of most Slurm clusters, built here from its release sources: enroot
# (its prefix in $(PYXIS_RUNTIME)/enroot) and pyxis ($(PYXIS_RUNTIME)/spank_pyxis.so, loaded by the
# nodes of `slipway cluster up --plugstack $(PYXIS_RUNTIME)/plugstack.conf`), for the tests marked
# pyxis (tests/test_pyxis.py finds them there) and for trying pyxis on the local cluster
# (docs/clusters.md). PYXIS_SOURCES: a folder holding the two release archives, checked against
# the sha256 pinned here (those of `git archive` of the release tags). enroot's git submodules are
# empty in such an archive: it builds against glibc (FORCE_GLIBC) with Debian's makeself and
# libbsd in their place. Seconds each; built once, again only when an archive is newer.
PYXIS_RUNTIME  := .pyxis
PYXIS_SOURCES  ?= $(wildcard ../shared/vendor)
ENROOT_RELEASE := enroot-4.1.2.tar.gz
ENROOT_SHA256  := 817e8d551135e6f3fc311d1ee57b03fb4d30325acba732f8dea43069ca11f8d3
PYXIS_RELEASE  := pyxis-0.24.0.tar.gz
PYXIS_SHA256   := 063653ba39125ac29796cc6079701d1ec34dd4c5baf698efacc0f36bf3619681
# To build both, and what enroot runs for slipway (podman:// imports, create, start, list).
PYXIS_PACKAGES := gcc make libc6-dev makeself libbsd-dev libslurm-dev squashfs-tools jq zstd bsdextrautils
ENROOT_BIN     := $(PYXIS_RUNTIME)/enroot/bin/enroot
PYXIS_PLUGIN   := $(PYXIS_RUNTIME)/spank_pyxis.so

comma := ,
ifneq ($(filter pyxis,$(MAKECMDGOALS)),)
PYXIS_ABSENT := $(strip $(foreach f,$(if $(wildcard $(ENROOT_BIN)),,$(ENROOT_RELEASE)) $(if $(wildcard $(PYXIS_PLUGIN)),,$(PYXIS_RELEASE)),$(if $(wildcard $(PYXIS_SOURCES)/$(f)),,$(f))))
ifneq ($(PYXIS_ABSENT),)
$(error make pyxis: $(subst $() ,$(comma) ,$(PYXIS_ABSENT)) not in $(or $(PYXIS_SOURCES),../shared/vendor (no such folder)): it builds from the release sources enroot-4.1.2.tar.gz (NVIDIA/enroot v4.1.2) and pyxis-0.24.0.tar.gz (NVIDIA/pyxis v0.24.0), each `git archive` of its tag: put both in ../shared/vendor, or in a folder FOLDER and run make pyxis PYXIS_SOURCES=FOLDER)
endif
endif

pyxis: $(ENROOT_BIN) $(PYXIS_PLUGIN) $(PYXIS_RUNTIME)/plugstack.conf

# The nodes' pyxis, with its default runtime path: `--node-private` gives each node its own, as it
# does enroot's directories, which enroot.conf pins below whatever XDG_* the submitting shell sets.
$(PYXIS_RUNTIME)/plugstack.conf: $(PYXIS_PLUGIN)
	@echo "required $(abspath $(PYXIS_PLUGIN)) runtime_path=/run/pyxis" > $@

# Debian's packages the build and enroot need, installed where missing (root, as .ci/run does).
define pyxis_packages
need=$$(for p in $(PYXIS_PACKAGES); do dpkg -s "$$p" >/dev/null 2>&1 || echo "$$p"; done); \
if [ -n "$$need" ] && command -v dpkg >/dev/null; then \
  if [ "$$(id -u)" != 0 ]; then echo "make pyxis: install Debian's $$(echo $$need) first (as root: apt-get install)" >&2; exit 1; fi; \
  echo "==> installing Debian's $$(echo $$need)"; \
  DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null || exit 1; \
fi
endef

# release_source ARCHIVE SHA256 DIR: the archive unpacked into DIR (new) once its sha256 is the one pinned.
define release_source
echo "$(2)  $(PYXIS_SOURCES)/$(1)" | sha256sum --check --status || { echo "make pyxis: $(PYXIS_SOURCES)/$(1) is not \
the release source pinned here (sha256 $(2)): put the one of the release tag there" >&2; exit 1; }; \
rm -rf $(3) && mkdir -p $(3) && tar -xzf $(PYXIS_SOURCES)/$(1) -C $(3) --strip-components=1
endef

$(ENROOT_BIN): $(wildcard $(PYXIS_SOURCES)/$(ENROOT_RELEASE))
	@$(pyxis_packages)
	@echo "==> building enroot from $(PYXIS_SOURCES)/$(ENROOT_RELEASE) into $(PYXIS_RUNTIME)/enroot"
	@src=$(PYXIS_RUNTIME)/build/enroot; $(call release_source,$(ENROOT_RELEASE),$(ENROOT_SHA256),$$src) && \
	mkdir -p $$src/deps/dist/makeself/bin && cp "$$(command -v makeself)" $$src/deps/dist/makeself/bin/enroot-makeself && \
	touch $$src/deps/makeself/.stamp $$src/deps/linux-headers/.stamp && rm -rf $(PYXIS_RUNTIME)/enroot && \
	if ! $(MAKE) -s -C $$src install prefix=$(abspath $(PYXIS_RUNTIME)/enroot) FORCE_GLIBC=1 \
	     LDLIBS="-l:libbsd.a $$(gcc -print-file-name=libbsd.so)" > $$src.log 2>&1; then \
	  tail -n 20 $$src.log; rm -rf $(PYXIS_RUNTIME)/enroot; echo "make pyxis: enroot did not build (its log: $$src.log)" >&2; exit 1; fi; \
	rm -rf $$src $$src.log; rmdir $(PYXIS_RUNTIME)/build 2>/dev/null; \
	printf '%s\n' '# make pyxis: where jobs unpack, whatever XDG_* they carry (the local cluster gives each node its own)' \
	  'ENROOT_RUNTIME_PATH /run/enroot' 'ENROOT_DATA_PATH $${HOME}/.local/share/enroot' \
	  'ENROOT_CACHE_PATH $${HOME}/.cache/enroot' >> $(PYXIS_RUNTIME)/enroot/etc/enroot/enroot.conf; \
	echo "    $(ENROOT_BIN): enroot $$($(ENROOT_BIN) version)"

$(PYXIS_PLUGIN): $(wildcard $(PYXIS_SOURCES)/$(PYXIS_RELEASE))
	@$(pyxis_packages)
	@echo "==> building pyxis from $(PYXIS_SOURCES)/$(PYXIS_RELEASE) into $(PYXIS_PLUGIN)"
	@src=$(PYXIS_RUNTIME)/build/pyxis; $(call release_source,$(PYXIS_RELEASE),$(PYXIS_SHA256),$$src) && \
	if ! $(MAKE) -s -C $$src > $$src.log 2>&1; then \
	  tail -n 20 $$src.log; echo "make pyxis: pyxis did not build (its log: $$src.log)" >&2; exit 1; fi; \
	mv $$src/spank_pyxis.so $(PYXIS_PLUGIN).tmp && mv $(PYXIS_PLUGIN).tmp $(PYXIS_PLUGIN) && rm -rf $$src $$src.log; rmdir $(PYXIS_RUNTIME)/build 2>/dev/null; \
	echo "    $(PYXIS_PLUGIN): pyxis $(patsubst pyxis-%.tar.gz,%,$(PYXIS_RELEASE))"

bench: $(STAMP)
	$(PY) bench/submit.py
	$(PY) bench/data.py

clean:
	rm -rf .pytest_cache build *.egg-info

# GPU readiness in one command (on a GPU machine, e.g. in the image): make test-gpu, then
# bench/trainer.py --matrix against torchtitan, written with the device and the date to
# gpu-report-DATE.md, a section ready to paste into BENCHMARKS.md.
.PHONY: gpu-report
gpu-report: $(STAMP)
	$(PY) bench/trainer.py --gpu-report $(ARGS)

# A GPU node's check, offline, in at most 10 minutes (docs/trainer.md, "checking a new cluster's GPU
# node"): report.md and report.json in OUT. With WHEELS=DIR (`make gpu-check-wheels` on a login
# node) it first makes .venv-gpucheck over this node's $(PYTHON) and its torch, from DIR alone.
# The node's site-packages are added by a .pth file, not --system-site-packages: a node's python3
# is often a venv itself, and a venv made from one sees the base interpreter's packages, not its.
# slipway's own wheel goes into the check's venv first, whatever slipway the node has (an older
# checkout's `pip install .` is the same version): the check runs the bundle's code.
OUT ?= gpu-check
GPU_CHECK_VENV ?= .venv-gpucheck
.PHONY: gpu-check gpu-check-wheels
ifdef WHEELS
gpu-check:
	@test -f '$(WHEELS)/requirements.txt' || { echo 'make gpu-check: WHEELS=$(WHEELS): no bundle there (from make' \
		'gpu-check-wheels on a login node)' >&2; exit 2; }
	$(PYTHON) -m venv '$(GPU_CHECK_VENV)'
	$(PYTHON) -c 'import site, sys; open(sys.argv[1] + "/slipway-node-site.pth", "w").write("".join( \
		"import site; site.addsitedir(%r)\n" % p for p in site.getsitepackages()))' \
		"$$('$(GPU_CHECK_VENV)/bin/python' -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
	'$(GPU_CHECK_VENV)/bin/python' -m pip install --no-index --no-deps --ignore-installed '$(WHEELS)'/slipway-*.whl
	'$(GPU_CHECK_VENV)/bin/python' -m pip install --no-index --find-links '$(WHEELS)' -r '$(WHEELS)/requirements.txt'
	'$(GPU_CHECK_VENV)/bin/slipway' gpu-check --out '$(OUT)' $(ARGS)
else
gpu-check: $(STAMP)
	$(PY) -m jobs gpu-check --out '$(OUT)' $(ARGS)
endif

# The wheels gpu-check needs beside a node's torch, for the node's Python and glibc (`ldd --version`),
# gathered where an index is reachable: at most 60 MiB. HAVE=FILE (the
# node's `python3 -m pip list --format=freeze`) leaves out what the node has.
WHEELS_OUT ?= gpu-check-wheels
PLATFORM ?= manylinux_2_28_x86_64
gpu-check-wheels: $(STAMP)
	$(PY) -m jobs.gpucheck.wheels --out '$(WHEELS_OUT)' --platform '$(PLATFORM)' \
		$(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) \
		$(if $(HAVE),--have '$(HAVE)')
