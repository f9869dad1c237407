# idem: idempotency keys decided inside PostgreSQL. `make help` lists the targets.
SHELL := /bin/bash
GO ?= go
# go.mod's toolchain line (a Go with the standard library's security fixes) is fetched through
# the module proxy when the installed Go is older; this machine's Go defaults to local.
export GOTOOLCHAIN ?= auto
# -vet=off: make lint runs go vet in full (both build tags); go test would run a part of it
# again for every package, on CI's critical path.
GOFLAGS_TEST ?= -race -count=1 -timeout 25m -vet=off
PKGS := ./...
# make test names its longest packages first (the rest follow, each once): go test runs two
# packages at a time on two cores, in this order, so a long package started last would run on
# alone at the end.
TEST_PKGS := ./cmd/server ./idem ./internal/dbidem ./internal/http ./tests $(PKGS)

.DEFAULT_GOAL := help

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-18s %s\n", $$1, $$2}'

.PHONY: build
build: ## build the reference server into bin/server
	$(GO) build -o bin/server ./cmd/server

.PHONY: run
run: ## serve on 127.0.0.1:8080 (a private PostgreSQL under .data/ when DATABASE_URL is unset)
	@$(GO) build -o bin/server ./cmd/server
	@# exec: the server gets Ctrl-C itself and stops cleanly (its private cluster too) with status
	@# 0; make, which gets the Ctrl-C as well, then reports 130 (under go run the server would exit 1)
	@exec bin/server serve

.PHONY: migrate
migrate: ## apply the migrations and install the SQL API into DATABASE_URL (or the .data/ cluster)
	$(GO) run ./cmd/server migrate

# The library's packages, whose coverage `make test` measures (over every test that runs them),
# and the floor it keeps (docs/DECISIONS.md D86).
COVERPKG := ./idem/...,./idemclient/...,./internal/canon/...,./internal/client/...,./internal/dbidem/...,./internal/http/...
COVER_FLOOR ?= 85

.PHONY: test
test: ## run every test (Go and pgTAP) against a real PostgreSQL, with the race detector; fails below COVER_FLOOR percent of the library covered
	$(GO) test $(GOFLAGS_TEST) -coverpkg=$(COVERPKG) -coverprofile=cover.out $(TEST_PKGS)
	@total=$$($(GO) tool cover -func=cover.out | awk '/^total:/ {sub("%", "", $$3); print $$3}'); \
	echo "coverage of the library's packages: $$total% (floor $(COVER_FLOOR)%)"; \
	awk -v t="$$total" -v f="$(COVER_FLOOR)" 'BEGIN { exit !(t + 0 >= f + 0) }' || \
	{ echo "coverage $$total% is below the floor of $(COVER_FLOOR)%"; exit 1; }

# The release whose server runs under traffic while this tree's migrate runs: 0.2.0 (its real
# server, built from git; TestUpgradeFrom020UnderTraffic) or 0.1.0 (its SQL and request flow;
# TestUpgradeUnderTraffic).
FROM ?= 0.2.0
UPGRADE_TEST_0.2.0 := TestUpgradeFrom020UnderTraffic
UPGRADE_TEST_0.1.0 := TestUpgradeUnderTraffic

.PHONY: upgrade-check
upgrade-check: ## the upgrade from FROM (0.2.0; or 0.1.0) under traffic at UPGRADE_KEYS keys (default 1.5 million): the old server's 5xx (none allowed) and slowest answer
	@test -n "$(UPGRADE_TEST_$(FROM))" || { echo "make upgrade-check: FROM=$(FROM): want 0.2.0 or 0.1.0" >&2; exit 2; }
	UPGRADE_KEYS=$${UPGRADE_KEYS:-1500000} $(GO) test -count=1 -timeout 60m -run '^$(UPGRADE_TEST_$(FROM))$$' -v ./cmd/server

.PHONY: upgrade-check-010
upgrade-check-010: ## make upgrade-check FROM=0.1.0: the upgrade from 0.1.0's SQL and request flow
	@$(MAKE) --no-print-directory upgrade-check FROM=0.1.0

# The snapshot of the Go vulnerability database that `make vuln` scans with (the module
# golang.org/x/vulndb from the module proxy; a newer pseudo-version is a newer database).
VULNDB := golang.org/x/vulndb@v0.0.0-20261105234957-e22db6528018

.PHONY: vuln
vuln: ## scan for known vulnerabilities the code calls (govulncheck, the pinned VULNDB snapshot); fails on one in a module
	@dir=$$($(GO) mod download -json $(VULNDB) | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$$/\1/p'); \
	test -n "$$dir" || { echo "vuln: could not download $(VULNDB)"; exit 1; }; \
	$(GO) run ./internal/tools/vulndb -osv "$$dir/data/osv" $(PKGS)

.PHONY: test-citus
test-citus: ## the Citus tests against the coordinator at CITUS_URL (scripts/citus-dev-cluster.sh; CI has no Citus)
	@if [ -z "$$CITUS_URL" ]; then \
		echo 'make test-citus: set CITUS_URL to a Citus coordinator (postgres://...), e.g.' >&2; \
		echo '  scripts/citus-dev-cluster.sh build && scripts/citus-dev-cluster.sh start' >&2; \
		echo '  CITUS_URL=$$(scripts/citus-dev-cluster.sh url) make test-citus' >&2; exit 2; fi
	$(GO) test $(GOFLAGS_TEST) -tags citus -run '^TestCitus' ./tests ./internal/dbidem ./cmd/server ./idem

# The history tests' long run: HISTORY_OPS operations (10,000) per harness, for at least
# HISTORY_SECONDS (120), through every fault, and the liveness scenarios (TestHTTPLiveness) for
# two minutes; docs/testing.md says how to read what they find.
HISTORY_TESTS := TestHTTPHistory|TestHTTPLiveness|TestSQLHistory|TestDoHistory

.PHONY: check-history
check-history: ## histories of real clients through every fault, checked by porcupine (minutes; HISTORY_OPS, HISTORY_SECONDS)
	HISTORY_MODE=long $(GO) test -count=1 -timeout 90m -v -run '^($(HISTORY_TESTS))$$' ./cmd/server ./internal/history

# The failover tests' long run (cmd/server/failover_test.go): a primary and its streaming
# standby, the server on a multi-host DATABASE_URL, FAILOVER_CLIENTS retrying clients for
# FAILOVER_SECONDS before the primary is killed (its WAL sender paused FAILOVER_PAUSE first) and
# as long after the standby's promotion; synchronous must lose nothing, the asynchronous run's
# losses are printed (docs/operations.md, "Replication and failover").
.PHONY: failover
failover: ## a primary killed and its standby promoted under traffic, synchronous and asynchronous (FAILOVER_SECONDS=20, FAILOVER_CLIENTS=8, FAILOVER_PAUSE=1500ms)
	FAILOVER_SECONDS=$${FAILOVER_SECONDS:-20} FAILOVER_CLIENTS=$${FAILOVER_CLIENTS:-8} FAILOVER_PAUSE=$${FAILOVER_PAUSE:-1500ms} \
		$(GO) test -count=1 -timeout 30m -run '^TestFailover' -v ./cmd/server

# The checker's own measure: each mutant of internal/history/mutants (a single-point change that
# breaks a promise) applied to a scratch copy of the tree (never this one), the short mode of the
# history tests run against it with each of MUTANT_SEEDS; a kill table (docs/testing.md).
MUTANT_SEEDS ?= 1,2,3

.PHONY: mutants
mutants: ## the history checker against its mutants, three seeds each, a kill table (about 16 min; MUTANTS=regexp for some)
	$(GO) run ./internal/tools/mutants -seeds $(MUTANT_SEEDS) -baseline -only '$(MUTANTS)' -out .artifacts/mutants.md

.PHONY: sql
sql: ## regenerate sql/idem.sql (the SQL API as one psql file) from sql/migrations and sql/functions
	$(GO) run ./internal/tools/sqlbundle

.PHONY: lint
lint: ## gofmt, go vet, staticcheck and plpgsql_check over every function
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) vet -tags citus $(PKGS)
	$(GO) tool staticcheck $(PKGS)
	$(GO) tool staticcheck -tags citus $(PKGS)
	$(GO) run ./internal/tools/sqllint

.PHONY: bench
bench: ## every benchmark figure with its target (fsync on, about 30 min; BENCH_ONLY=sql,... for parts)
	$(GO) run ./internal/tools/bench

.PHONY: clean
clean: ## stop nothing, remove build output (the .data/ cluster stays)
	rm -rf bin
