# idem: idempotency keys decided inside PostgreSQL. `make help` lists the targets.
SHELL := /bin/bash
GO ?= go
GOFLAGS_TEST ?= -race -count=1
PKGS := ./...

.DEFAULT_GOAL := help

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-14s %s\n", $$1, $$2}'

.PHONY: build
build: ## build the reference server into bin/server
	$(GO) build -o bin/server ./cmd/server

.PHONY: run
run: ## serve on 127.0.0.1:8080 (a private PostgreSQL under .data/ when DATABASE_URL is unset)
	@$(GO) build -o bin/server ./cmd/server
	@# exec: the server gets Ctrl-C itself, stops cleanly and make exits 0 (go run would exit 1)
	@exec bin/server serve

.PHONY: migrate
migrate: ## apply the migrations and install the SQL API into DATABASE_URL (or the .data/ cluster)
	$(GO) run ./cmd/server migrate

.PHONY: test
test: ## run every test (Go and pgTAP) against a real PostgreSQL, with the race detector
	$(GO) test $(GOFLAGS_TEST) $(PKGS)

# The history tests' long run: HISTORY_OPS operations (10,000) per harness, for at least
# HISTORY_SECONDS (120), through every fault; docs/testing.md says how to read what it finds.
HISTORY_TESTS := TestHTTPHistory|TestSQLHistory|TestDoHistory

.PHONY: check-history
check-history: ## histories of real clients through every fault, checked by porcupine (minutes; HISTORY_OPS, HISTORY_SECONDS)
	HISTORY_MODE=long $(GO) test -count=1 -timeout 90m -v -run '^($(HISTORY_TESTS))$$' ./cmd/server ./internal/history

.PHONY: sql
sql: ## regenerate sql/idem.sql (the SQL API as one psql file) from sql/migrations and sql/functions
	$(GO) run ./internal/tools/sqlbundle

.PHONY: lint
lint: ## gofmt, go vet, staticcheck and plpgsql_check over every function
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) tool staticcheck $(PKGS)
	$(GO) run ./internal/tools/sqllint

.PHONY: bench
bench: ## every benchmark figure with its target (fsync on, about 25 min; BENCH_ONLY=sql,... for parts)
	$(GO) run ./internal/tools/bench

.PHONY: clean
clean: ## stop nothing, remove build output (the .data/ cluster stays)
	rm -rf bin
