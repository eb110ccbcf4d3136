# qdelay: one command to set everything up and run (make run), one to set up and test (make test).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROTOS := $(wildcard proto/qdelay/v1/*.proto)
GEN    := $(PROTOS:.proto=_pb2.py)
export SPARK_LOCAL_IP := 127.0.0.1

.PHONY: setup native-check proto run run-cluster lint typecheck test test-fast bench bench-deps native-deps node-deps etcd-deps clean

setup: $(STAMP) proto etcd-deps native-check

# The C extensions are optional to pip (the Python twins run where one is missing), so a
# failed build would pass unnoticed, only slower: this fails the set-up (and forgets the
# install, so that the next `make setup` builds again) when an extension this machine can
# build is not importable; it only warns where a compiler or a header is missing.
native-check: $(STAMP)
	@$(BIN)/python -m qdelay.extensions || (rm -f $(STAMP); exit 1)

# cluster mode (--etcd) and its tests need an etcd binary: Debian's etcd-server (3.4.x);
# where it cannot be installed the cluster tests skip and say so
etcd-deps:
	@command -v etcd >/dev/null || (apt-get update -q && apt-get install -y -q etcd-server) >/dev/null 2>&1 || \
		echo "etcd-server could not be installed: the cluster tests will be skipped"

# The native codec compiles XXH3 from the system's xxhash.h (Debian libxxhash-dev). Where
# it is missing and cannot be installed the set-up goes on: the extension is optional and
# the Python twins run.
native-deps:
	@test -f /usr/include/xxhash.h || \
		(apt-get update -q && apt-get install -y -q libxxhash-dev) || \
		echo "libxxhash-dev not installed: the native codec will not be built (Python twins run)"

# the install also builds the native extensions (segments/_codec.c, qdelay/_wire.c, qdelay/_handoff.c) next to their sources
$(STAMP): pyproject.toml segments/_codec.c qdelay/_wire.c qdelay/_handoff.c segments/layout.h segments/pyint.h | native-deps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[server,dev,test,spark,bench]'
	touch $@

# Generated gRPC code is built from proto/, never edited or committed.
proto: $(GEN)

proto/qdelay/v1/%_pb2.py: proto/qdelay/v1/%.proto $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto $<

node-deps: examples/node/node_modules/.package-lock.json

examples/node/node_modules/.package-lock.json: examples/node/package.json examples/node/package-lock.json
	cd examples/node && npm ci --no-audit --no-fund --silent

run: setup
	$(BIN)/qdelay server --data-dir ./data --listen 127.0.0.1:7600

# etcd + 2 shards x 2 nodes on loopback (data in ./data-cluster), until Ctrl-C
run-cluster: setup
	$(BIN)/qdelay cluster up --data-dir ./data-cluster --shards 2 --nodes 2

# the gate: lint, format check and type check (configuration in pyproject.toml)
lint: setup
	$(BIN)/ruff check -q .
	$(BIN)/ruff format --check -q .
	$(MAKE) --no-print-directory typecheck

# mypy cannot follow the editable install's import hook (qdelay.segments lives in segments/,
# ...), so it checks a tree of links laid out as the installed package
TYPED := build/typed/qdelay
typecheck: setup
	@rm -rf build/typed && mkdir -p $(TYPED)
	@for f in qdelay/*.py; do ln -s ../../../$$f $(TYPED)/; done
	@for d in segments server client replication tools; do ln -s ../../../$$d $(TYPED)/$$d; done
	@ln -s ../../../proto/qdelay/v1 $(TYPED)/v1
	cd build/typed && ../../$(BIN)/mypy --config-file ../../pyproject.toml

test: setup lint $(if $(wildcard examples/node/package.json),node-deps)
	$(BIN)/python -m pytest -q --durations=15 -n 2 --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not spark"

bench-deps: setup
	command -v redis-server >/dev/null && command -v beanstalkd >/dev/null || \
		(apt-get update -q && apt-get install -y -q redis-server beanstalkd)

bench: bench-deps
	$(BIN)/python -m bench.all

clean:
	rm -rf $(VENV) $(GEN) proto/qdelay/v1/*_pb2*.py proto/qdelay/v1/*_pb2*.pyi segments/_codec*.so qdelay/_wire*.so build
