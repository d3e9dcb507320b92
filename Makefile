# Stepguard: `make run` starts the demo, `make test` runs the whole suite. `make help` lists all.
PYTHON ?= python3
VENV ?= .venv
# Extra requirements on top of the project's, e.g. DJANGO='django>=6,<7' (CI's second pass).
DJANGO ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PORT ?= 8000
# Test processes (pytest-xdist): one per core; each has its own test database.
TEST_PROCESSES ?= auto

.DEFAULT_GOAL := help
.PHONY: help install run test lint format bench bench-ui screenshots

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' $(if $(DJANGO),'$(DJANGO)')
	touch $(STAMP)

install: $(STAMP) ## create the virtualenv and install Stepguard with its dev tools

run: $(STAMP) ## migrate SQLite, create a demo operator, serve on 127.0.0.1:$(PORT), run a worker and the demo agents
	DJANGO_SETTINGS_MODULE=examples.settings $(BIN)/python manage.py rundemo --port $(PORT)

test: $(STAMP) ## lint, type-check the SDK, check migrations, run the whole suite (DATABASE_URL picks the engine)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	DJANGO_SETTINGS_MODULE=tests.settings $(BIN)/python manage.py makemigrations --check --dry-run
	DJANGO_SETTINGS_MODULE=tests.settings $(BIN)/mypy
	$(BIN)/pytest -n $(TEST_PROCESSES)

lint: $(STAMP) ## ruff check
	$(BIN)/ruff check .

format: $(STAMP) ## ruff format
	$(BIN)/ruff format .

screenshots: $(STAMP) ## every page, light, dark and narrow, as PNGs in var/screenshots/ (three go to docs/)
	STEPGUARD_SCREENSHOTS=var/screenshots $(BIN)/pytest -q tests/test_browser.py tests/test_browser_fork_edits.py tests/test_browser_runview.py -k "accessibility or 360 or fork or trace or trends or waterfall"
	@ls var/screenshots
	mkdir -p docs/screenshots
	cp var/screenshots/light-run-failed.png var/screenshots/dark-run-detail.png var/screenshots/narrow-runs-list.png var/screenshots/light-fork-with-edits.png var/screenshots/light-run-edited-fork.png var/screenshots/light-run-trace.png var/screenshots/light-run-annotations.png var/screenshots/light-trends.png var/screenshots/waterfall-1440.png docs/screenshots/

bench: $(STAMP) ## step overhead, replay and throughput benchmarks on local PostgreSQL
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/steps.py

bench-ui: $(STAMP) ## dashboard server times (100,000 runs) and live-feed latency on local PostgreSQL
	$(BIN)/python bench/ui.py
