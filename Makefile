# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing
# and reinstalls only when pyproject.toml or constraints.txt changed (the stamp file).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# gguf + engines: the GGUF tests compare with llama.cpp itself (tests/interop/test_gguf_*.py), so the
# test install builds llama-cpp-python from its sdist (no CPU wheel): ~5 min on 2 cores, once per venv.
EXTRAS ?= dev,bench,gguf,engines
# The suite on both cores: two pytest-xdist workers, each test at TORCHFORMER_TEST_THREADS torch
# threads (default 1, tests/conftest.py); tests sharing one slow setup (the front door's trained
# run, the docs' shrunk demos) are kept on one worker by their xdist_group (--dist loadgroup).
TEST_WORKERS ?= 2

.PHONY: install prepare test test-native-off demo lint bench bench-engines clean browser docs

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	CMAKE_ARGS="$(ENGINES_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  $(BIN)/pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	$(MAKE) --no-print-directory prepare
	touch $(STAMP)

# What the first run or test would otherwise stop to make, made once at install (issue 33: on a
# fresh clone the first test to need them waited ~40-130 s, with the other worker idle or slowed):
# the native CPU kernels (fast/native.py; where they cannot build, the library paths run, so a
# failed build does not fail the install), llama.cpp's converter source (the llama-cpp-python
# sdist's vendored tree, which the GGUF tests convert with; benchmarks/engines.py llama_source), and
# the bytecode an editable install skips: the package's and the tests' (pytest's assert-rewritten
# test modules). Written here even under PYTHONDONTWRITEBYTECODE, as pip byte-compiles a wheel;
# without it every interpreter compiles the sources again (each test worker's collection ~4-5 s).
prepare:
	$(BIN)/torchformer kernels build || echo "the CPU kernels did not build: the library paths will run"
	$(BIN)/python -c "from benchmarks.engines import CACHE, llama_source; print('llama.cpp source:', llama_source(CACHE))"
	$(BIN)/python -m compileall -q src tests benchmarks/*.py
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --collect-only -q -p no:cacheprovider tests > /dev/null 2>&1 \
	  || echo "the tests did not collect: make test will say why"

test: $(STAMP) browser
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=30 tests

# The generation tests once more on the library paths alone (TORCHFORMER_NATIVE=0: no native
# kernels, as a CPU without AVX-512 or a compiler runs them); CI runs it after `make test`.
test-native-off: $(STAMP)
	TORCHFORMER_NATIVE=0 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup tests/generation

# The attention explorer's test opens its HTML in Debian's headless chromium (via chromium-driver);
# installed only when missing. CI and the project's machines run as root with Debian's archive.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	  else \
	    echo "chromium missing: sudo apt-get install chromium chromium-driver (the browser test fails in CI without it)"; \
	  fi; \
	fi

demo: $(STAMP)
	$(BIN)/torchformer demo

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

# torchformer against llama.cpp and CTranslate2 (benchmarks/engines.py, issue 25). The `engines` extra
# builds llama-cpp-python from its sdist (no CPU wheel; ~5 min on 2 cores), once: skipped when importable.
ENGINES_CMAKE_ARGS := -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
bench-engines: $(STAMP)
	$(BIN)/python -c "import llama_cpp, ctranslate2, sentencepiece" 2>/dev/null || \
	  CMAKE_ARGS="$(ENGINES_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  nice -n 19 $(BIN)/pip install -q -c constraints.txt -e ".[$(EXTRAS),engines]"
	$(BIN)/python -m benchmarks.engines $(ARGS)

clean:
	rm -rf $(VENV) runs site .pytest_cache

# The documentation site (mkdocs-material + mkdocstrings, the `docs` extra) into site/, strict: a
# broken link, a missing reference or a page outside the nav fails the build.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site
