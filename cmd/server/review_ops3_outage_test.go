package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

func getWithin(url string, timeout time.Duration) (int, string, time.Duration, error) {
	c := &http.Client{Timeout: timeout}
	began := time.Now()
	res, err := c.Get(url)
	if err != nil {
		return 0, "", time.Since(began), err
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b), time.Since(began), nil
}

func metricValue(body, name string) (float64, bool) {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindStringSubmatch(body)
	if m == nil {
		return 0, false
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v, true
}

// TestReviewOps3DatabaseOutage: the database goes away (refused, connections cut) and comes back.
// During: /healthz answers 503 promptly, /metrics still answers, a keyed request is answered
// 503 with Retry-After, a scheduled cleanup pass counts as failed (IdemCleanupFailing), and the
// key gauges are absent (IdemKeyGaugesAbsent). The keyed request is not counted store_error:
// the bearer token's lookup fails before the middleware, as docs/operations.md says (D171).
// After: /healthz 200 and keyed requests succeed, without a restart.
func TestReviewOps3DatabaseOutage(t *testing.T) {
	t.Parallel()
	base := startServer(t, nil)
	proxy := dbProxy(t)
	listen := proxy.Listen
	log := &logBuffer{}
	s := serveWith(t, pgtest.Via(t, base.db, listen), base.db, map[string]string{"CLEANUP_INTERVAL": "1s"}, log)
	_, token := s.principal("out")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "d0", `{"amount":1}`); r.status != 201 {
		t.Fatalf("before: %+v", r)
	}
	time.Sleep(1500 * time.Millisecond) // a cleanup pass ran

	// The outage: refused, and every connection cut.
	proxy.Stop()
	st, body, took, err := getWithin(s.url+"/healthz", 10*time.Second)
	t.Logf("outage: /healthz %d %s in %v (%v)", st, body, took, err)
	if st != 503 || took > 3*time.Second {
		t.Errorf("/healthz during the outage: %d in %v, want 503 within 3s", st, took)
	}
	r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "d1", `{"amount":1}`)
	t.Logf("outage: keyed deposit %d %v %s", r.status, r.header.Get("Retry-After"), r.body)
	if r.status != 503 || r.header.Get("Retry-After") == "" {
		t.Errorf("keyed deposit during the outage: %d (Retry-After %q), want 503 with Retry-After", r.status, r.header.Get("Retry-After"))
	}
	time.Sleep(2500 * time.Millisecond) // at least one scheduled pass during the outage
	st, mbody, took, err := getWithin(s.url+"/metrics", 10*time.Second)
	if st != 200 || took > 5*time.Second {
		t.Errorf("/metrics during the outage: %d in %v (%v)", st, took, err)
	}
	failed, _ := metricValue(mbody, `idem_cleanup_passes_total{result="failed"}`)
	storeErr, _ := metricValue(mbody, `idempotency_requests_total{action="POST /v1/accounts/{id}/deposits",state="store_error"}`)
	_, backlog := metricValue(mbody, `idempotency_cleanup_backlog`)
	t.Logf("outage metrics: cleanup failed %v, store_error %v, backlog gauge present %v", failed, storeErr, backlog)
	if failed == 0 {
		t.Errorf("no cleanup pass counted failed during a 2.5s outage with CLEANUP_INTERVAL=1s:\n%s", linesWith(mbody, "idem_cleanup"))
	}
	if storeErr != 0 {
		t.Errorf("store_error %v during an outage that the token lookup meets first (docs/operations.md)", storeErr)
	}
	if backlog {
		t.Errorf("the key gauges are still exported during the outage (docs: absent when the query fails)")
	}

	// The database returns.
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, body, _, _ = getWithin(s.url+"/healthz", 5*time.Second)
		if st == 200 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if st != 200 {
		t.Errorf("/healthz after the database returned: %d %s", st, body)
	}
	if r := s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "d1", `{"amount":1}`); r.status != 201 {
		t.Errorf("the retry after the outage: %+v", r)
	}
	if n := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE state <> 'c'`); n != 0 {
		t.Errorf("%d keys left claimed", n)
	}
	if strings.Count(log.String(), `"level":"ERROR"`) == 0 {
		t.Logf("no ERROR logged during the outage")
	}
}

func linesWith(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestReviewOps3DatabaseStall: the network path to the database stops answering (a blackhole: nothing
// refused, nothing closed). docs/operations.md: /healthz answers 503 when the database does
// not answer, and the key gauges go absent. After the stall the server serves again and the
// cleaner's passes run, without a restart. (During it, the cleaner's batch waited without a
// bound, past any 4 s stall: it is cut at CleanupBatchTimeout now, D171.)
func TestReviewOps3DatabaseStall(t *testing.T) {
	t.Parallel()
	base := startServer(t, nil)
	proxy := dbProxy(t)
	log := &logBuffer{}
	s := serveWith(t, pgtest.Via(t, base.db, proxy.Listen), base.db, map[string]string{"CLEANUP_INTERVAL": "1s", "LOG_LEVEL": "debug"}, log)
	_, token := s.principal("stall")
	id := int(s.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`).json(t)["id"].(float64))
	time.Sleep(1500 * time.Millisecond)
	_, m0, _, _ := getWithin(s.url+"/metrics", 10*time.Second)
	done0, _ := metricValue(m0, `idem_cleanup_passes_total{result="done"}`)

	for _, stream := range []string{"upstream", "downstream"} {
		if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
			`{"name":"stall-%s","type":"timeout","stream":%q,"toxicity":1,"attributes":{"timeout":0}}`, stream, stream))); err != nil {
			t.Fatal(err)
		}
	}
	st, body, took, err := getWithin(s.url+"/healthz", 10*time.Second)
	t.Logf("stall: /healthz %d %s in %v (%v)", st, body, took, err)
	if st != 503 || took > 3*time.Second {
		t.Errorf("/healthz during the stall: %d in %v, want 503 within 3s", st, took)
	}
	dep := make(chan resp, 1)
	began := time.Now()
	go func() {
		dep <- s.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "s1", `{"amount":1}`)
	}()
	time.Sleep(4 * time.Second)
	st, mbody, took, err := getWithin(s.url+"/metrics", 10*time.Second)
	t.Logf("stall: /metrics %d in %v (%v)", st, took, err)
	failed, _ := metricValue(mbody, `idem_cleanup_passes_total{result="failed"}`)
	done1, _ := metricValue(mbody, `idem_cleanup_passes_total{result="done"}`)
	t.Logf("stall metrics: cleanup done %v -> %v, failed %v", done0, done1, failed)
	select {
	case r := <-dep:
		t.Logf("stall: keyed deposit %d after %v: %s", r.status, time.Since(began), r.body)
	default:
		t.Logf("stall: keyed deposit still unanswered after %v", time.Since(began))
	}
	// The path recovers.
	for _, stream := range []string{"upstream", "downstream"} {
		_ = proxy.Toxics.RemoveToxic(context.Background(), "stall-"+stream)
	}
	select {
	case r := <-dep:
		t.Logf("after: keyed deposit %d after %v", r.status, time.Since(began))
	case <-time.After(30 * time.Second):
		t.Errorf("the keyed deposit got no answer 30s after the path recovered")
	}
	time.Sleep(3 * time.Second)
	_, m2, _, _ := getWithin(s.url+"/metrics", 10*time.Second)
	done2, _ := metricValue(m2, `idem_cleanup_passes_total{result="done"}`)
	failed2, _ := metricValue(m2, `idem_cleanup_passes_total{result="failed"}`)
	t.Logf("after: cleanup done %v, failed %v", done2, failed2)
	if done2 <= done1 {
		t.Errorf("no cleanup pass was done in the 3 s after the stall (done %v -> %v)", done1, done2)
	}
	// A pass's batch held by the stall is cut at CleanupBatchTimeout (two minutes), past this
	// test: TestCleanerBatchBoundFailsThePass shows the bound.
	if st, _, _, _ := getWithin(s.url+"/healthz", 5*time.Second); st != 200 {
		t.Errorf("/healthz after the stall: %d", st)
	}
}
