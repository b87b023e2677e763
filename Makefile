# Shortcuts; dev.sh does the work (and creates .venv on first use).
.PHONY: demo test test-slow bench bench-full bench-report

demo:
	./dev.sh demo

test:
	./dev.sh test

test-slow:
	./dev.sh test-slow

bench:          # quick versions of all benchmarks, about 38 minutes on 2 cores
	./dev.sh bench

bench-full:     # the long versions
	./dev.sh bench --full

bench-report:   # re-render BENCHMARKS.md from bench/results/*.json
	./dev.sh bench --report-only
