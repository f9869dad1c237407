package main

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"
)

// metricName matches what may be a metric of this project in a query.
var metricName = regexp.MustCompile(`\bidem[a-z_]*\b`)

// TestDashboardAndAlertsNameServerMetrics: every query of docs/grafana-dashboard.json and every
// alert rule of docs/operations.md names only metrics that the reference server exports, and
// the dashboard has a panel for each thing operators watch. The server runs keyed requests, a
// replay, a payout (a lease route) and a cleanup pass first, so that every metric has a value.
func TestDashboardAndAlertsNameServerMetrics(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"CLEANUP_INTERVAL": "1s", "PAYOUTS_LEASE": "1s", "PAYOUT_PROVIDER_DELAY": "700ms"})
	_, token := s.principal("metrics")
	account := int(s.call("POST", "/v1/accounts", token, "m-1", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	s.call("POST", "/v1/accounts", token, "m-1", `{"name":"a","currency":"EUR"}`)
	if r := s.call("POST", "/v1/payouts", token, "m-2", fmt.Sprintf(`{"account":%d,"amount":1}`, account)); r.status != 201 {
		t.Fatalf("payout: %+v", r)
	}
	time.Sleep(1500 * time.Millisecond) // a cleanup pass
	exported := map[string]bool{}
	for _, line := range strings.Split(s.call("GET", "/metrics", "", "", "").body, "\n") {
		if f := strings.Fields(line); len(f) >= 3 && f[0] == "#" && f[1] == "TYPE" {
			exported[f[2]] = true
			if f[3] == "histogram" {
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					exported[f[2]+suffix] = true
				}
			}
		}
	}
	check := func(where, query string) {
		for _, name := range metricName.FindAllString(query, -1) {
			if !exported[name] {
				t.Errorf("%s names %s, which the server does not export: %s", where, name, query)
			}
		}
	}

	raw, err := os.ReadFile("../../docs/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	all := ""
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, target := range p.Targets {
			check("panel "+p.Title, target.Expr)
			all += target.Expr + "\n"
		}
	}
	for _, want := range []string{"idempotency_requests_total", `state="replayed"`, `state="key_reused"`, "idempotency_waiting_duplicates",
		"idem_cleanup_deleted_total", "idempotency_cleanup_backlog", "idempotency_lease_extensions_total", "idempotency_oldest_in_progress_seconds"} {
		if !strings.Contains(all, want) {
			t.Errorf("no panel of the dashboard queries %s", want)
		}
	}

	ops, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rules, ok := strings.Cut(string(ops), "<!-- alerts:begin -->")
	rules, _, ok2 := strings.Cut(rules, "<!-- alerts:end -->")
	if !ok || !ok2 {
		t.Fatal("docs/operations.md has no alerts block")
	}
	n := 0
	for _, line := range strings.Split(rules, "\n") {
		if expr, ok := strings.CutPrefix(strings.TrimSpace(line), "expr:"); ok {
			check("alert rule", expr)
			n++
		}
	}
	if n < 5 {
		t.Fatalf("only %d alert rules found", n)
	}
	// Every query of a promql block (the ratios worth a panel, and any other) too.
	blocks := 0
	for rest := string(ops); ; {
		_, after, found := strings.Cut(rest, "```promql\n")
		if !found {
			break
		}
		block, tail, _ := strings.Cut(after, "```")
		for _, line := range strings.Split(block, "\n") {
			if q := strings.TrimSpace(line); q != "" && !strings.HasPrefix(q, "#") {
				check("promql block", q)
			}
		}
		blocks++
		rest = tail
	}
	if blocks == 0 {
		t.Fatal("docs/operations.md has no promql block")
	}
}
