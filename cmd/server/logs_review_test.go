package main

// The logs as an operator reads them and as a hostile client could fill them (a review, D233):
// the request line's size, forged lines, the levels of client mistakes, an outage's rate.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// logsBuf is a log sink safe to read while the server writes to it.
type logsBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *logsBuf) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *logsBuf) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func (b *logsBuf) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Len()
}

// logsLines parses the JSON lines of a log; lines that are not JSON objects are returned
// apart.
func logsLines(s string) (lines []map[string]any, notJSON []string) {
	sc := bufio.NewScanner(strings.NewReader(s))
	sc.Buffer(make([]byte, 0, 64<<10), 64<<20)
	for sc.Scan() {
		l := sc.Text()
		if strings.TrimSpace(l) == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			notJSON = append(notJSON, l)
			continue
		}
		lines = append(lines, m)
	}
	return lines, notJSON
}

// logsRaw sends raw bytes on a fresh connection and returns the status line of the answer.
func logsRaw(t *testing.T, url, raw string) string {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.WriteString(c, raw); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line)
}

// TestLogsHostileRequestLineBounded: an unauthenticated client sends one request whose path
// (or method) is half a megabyte; the server answers 404/405, and its request log line holds
// the whole path until D233: the log grew by as much as the request line for every such
// request, where the request id next to it is bounded to 64 characters. A production request
// log bounds what a client may put into one line (the nginx default caps a request line at 8
// KiB); the line logs the first 32 bytes of the method and 1,024 of the path now.
func TestLogsHostileRequestLineBounded(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	log := &logsBuf{}
	logged := serveWith(t, s.db, s.db, nil, log)
	const n = 512 << 10
	cases := []struct{ name, raw string }{
		{"long path", "GET /" + strings.Repeat("a", n) + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"},
		{"long method", strings.Repeat("A", n) + " /v1/accounts HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"},
	}
	for _, c := range cases {
		before := log.Len()
		status := logsRaw(t, logged.url, c.raw)
		time.Sleep(200 * time.Millisecond) // the request line is logged after the answer
		grew := log.Len() - before
		t.Logf("%s: sent %d bytes, answered %q, the log grew by %d bytes", c.name, len(c.raw), status, grew)
		if grew > 16<<10 {
			t.Errorf("%s: one unauthenticated request (%d bytes, answered %q) wrote %d bytes to the log: "+
				"what a client puts in a log line is not bounded", c.name, len(c.raw), status, grew)
		}
	}
}

// TestLogsHostilePathAmplified: the request log's path is the decoded URL path, written
// JSON-escaped: %01 (3 bytes sent) is logged as \u0001 (6 bytes), and %FF (a byte that is not
// UTF-8) as \ufffd. A path of them made the log grow by twice what the client sent until D233:
// one unauthenticated request of about 1 MiB (net/http's header limit) wrote about 2 MiB of log.
func TestLogsHostilePathAmplified(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	log := &logsBuf{}
	logged := serveWith(t, s.db, s.db, nil, log)
	const n = 256 << 10
	for _, c := range []struct{ name, path string }{
		{"%01", "/" + strings.Repeat("%01", n/3)},
		{"%FF", "/" + strings.Repeat("%FF", n/3)},
	} {
		raw := "GET " + c.path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
		before := log.Len()
		status := logsRaw(t, logged.url, raw)
		time.Sleep(200 * time.Millisecond)
		grew := log.Len() - before
		t.Logf("path of %s: sent %d bytes, answered %q, the log grew by %d bytes (%.1fx)", c.name, len(raw), status, grew,
			float64(grew)/float64(len(raw)))
		if grew > len(raw)+4096 {
			t.Errorf("path of %s: one unauthenticated request of %d bytes (answered %q) wrote %d bytes of log (%.1fx what it sent)",
				c.name, len(raw), status, grew, float64(grew)/float64(len(raw)))
		}
	}
}

// TestLogsNoForgedLines: a client cannot add a line to the log, nor break one, through the
// path (%0A decoded), the request id, the key or the user agent: every line is one JSON object,
// and the forged text only appears inside a string.
func TestLogsNoForgedLines(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	log := &logsBuf{}
	logged := serveWith(t, s.db, s.db, nil, log)
	_, token := s.principal("logs-forge")
	forged := `{"level":"ERROR","msg":"FORGED"}`
	esc := strings.NewReplacer(`{`, "%7B", `}`, "%7D", `"`, "%22", `:`, "%3A", `,`, "%2C").Replace(forged)
	logged.call("GET", "/v1/accounts/1%0A"+esc+"%0D%0A", token, "", "")
	logged.call("GET", "/nowhere%0A"+esc, "", "", "")
	logged.call("POST", "/v1/accounts", token, "k\tFORGED", `{"name":"a","currency":"EUR"}`,
		"Content-Type", "application/json", "X-Request-Id", "FORGED\x7f", "User-Agent", "x\x1b[2J"+forged)
	// Raw bytes net/http takes in a header value: obs-text and a tab.
	logsRaw(t, logged.url, "GET /v1/accounts HTTP/1.1\r\nHost: x\r\nX-Request-Id: a\tb\x85"+forged+"\r\nConnection: close\r\n\r\n")
	if err := logged.shutdown(); err != nil {
		t.Fatal(err)
	}
	lines, notJSON := logsLines(log.String())
	if len(notJSON) > 0 {
		t.Fatalf("log lines that are not JSON: %q", notJSON)
	}
	for _, l := range lines {
		if l["msg"] == "FORGED" {
			t.Fatalf("a forged line is in the log: %v", l)
		}
	}
}

// TestLogsClientMistakesNotWarnings: client mistakes (no or a bad token, a malformed key, a
// key reused for another body, a body too large, malformed JSON, an unknown route, a client
// that gives up while its request waits) are answered 4xx and must not log at WARN or ERROR:
// an operator's error channel is not a client's to fill.
func TestLogsClientMistakesNotWarnings(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	log := &logsBuf{}
	logged := serveWith(t, s.db, s.db, nil, log)
	_, token := s.principal("logs-mistakes")
	acct := logged.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`, "Content-Type", "application/json").json(t)
	id := int(acct["id"].(float64))
	dep := fmt.Sprintf("/v1/accounts/%d/deposits", id)
	ct := []string{"Content-Type", "application/json"}
	type call struct {
		name, method, path, token, key, body string
		headers                              []string
	}
	calls := []call{
		{"no token", "POST", dep, "", "k1", `{"amount":1}`, ct},
		{"bad token", "POST", dep, "nope", "k1", `{"amount":1}`, ct},
		{"long key", "POST", dep, token, strings.Repeat("k", 300), `{"amount":1}`, ct},
		{"key with a space", "POST", dep, token, "a b", `{"amount":1}`, ct},
		{"first", "POST", dep, token, "reuse", `{"amount":1}`, ct},
		{"replay", "POST", dep, token, "reuse", `{"amount":1}`, ct},
		{"reuse", "POST", dep, token, "reuse", `{"amount":2}`, ct},
		{"too large", "POST", dep, token, "big", `{"amount":1,"x":"` + strings.Repeat("x", 2<<20) + `"}`, ct},
		{"malformed", "POST", dep, token, "mal", `{"amount":`, ct},
		{"duplicate member", "POST", dep, token, "dup", `{"amount":1,"amount":2}`, ct},
		{"string amount", "POST", dep, token, "str", `{"amount":"1"}`, ct},
		{"zero amount", "POST", dep, token, "zero", `{"amount":0}`, ct},
		{"not json", "POST", dep, token, "xml", `<a/>`, []string{"Content-Type", "application/xml"}},
		{"unknown route", "GET", "/nowhere", "", "", "", nil},
		{"wrong method", "DELETE", "/v1/accounts", token, "", "", nil},
		{"no account", "POST", "/v1/accounts/999999/deposits", token, "na", `{"amount":1}`, ct},
		{"transfer without key", "POST", "/v1/transfers", token, "", `{"from":1,"to":2,"amount":1}`, ct},
	}
	for _, c := range calls {
		r := logged.call(c.method, c.path, c.token, c.key, c.body, c.headers...)
		if c.name != "first" && c.name != "replay" && (r.status < 400 || r.status >= 500) {
			t.Logf("%s: answered %d %s", c.name, r.status, r.body)
		}
	}
	// A client that gives up while its deposit waits on the account's row (another
	// transaction holds it), and the same with a key that another request holds.
	ctx := context.Background()
	conn := pgtest.Connect(t, s.db)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgtest.Exec(t, tx, `SELECT 1 FROM ledger.accounts WHERE id = $1 FOR UPDATE`, id)
	var wg sync.WaitGroup
	for i, key := range []string{"gone1", "gone1", "gone2", ""} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, time.Duration(500+300*i)*time.Millisecond)
			defer cancel()
			pgtest.Send(t, cctx, "POST", logged.url+dep, `{"amount":1}`, "Authorization", "Bearer "+token,
				"Idempotency-Key", key, "Content-Type", "application/json", "X-Request-Id", fmt.Sprintf("gone-%d", i))
		}()
	}
	wg.Wait()
	time.Sleep(300 * time.Millisecond)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if err := logged.shutdown(); err != nil {
		t.Fatal(err)
	}
	lines, notJSON := logsLines(log.String())
	if len(notJSON) > 0 {
		t.Errorf("log lines that are not JSON: %q", notJSON)
	}
	gone := 0
	for _, l := range lines {
		if lv, _ := l["level"].(string); lv == "WARN" || lv == "ERROR" {
			b, _ := json.Marshal(l)
			t.Errorf("a client's mistake logged at %s: %s", lv, b)
		}
		// docs/operations.md: status 499 when the client went away before anything was answered.
		if id, _ := l["request_id"].(string); strings.HasPrefix(id, "gone-") && l["msg"] == "request" {
			gone++
			if l["status"] != float64(499) {
				t.Errorf("a client that went away before its answer is logged with status %v: %v", l["status"], l)
			}
		}
	}
	if gone != 4 {
		t.Errorf("%d request lines for the 4 clients that went away", gone)
	}
	if t.Failed() || testing.Verbose() {
		t.Logf("log:\n%s", log.String())
	}
}

// TestLogsDocumentedKeyedLine: docs/operations.md "Logs": "A keyed request that was neither
// acquired nor replayed logs a line with its state ..., the action, its request_id and
// key_hash (12 hex digits ...)", and keys are never logged.
func TestLogsDocumentedKeyedLine(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	log := &logsBuf{}
	logged := serveWith(t, s.db, s.db, nil, log)
	_, token := s.principal("logs-doc")
	acct := logged.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`, "Content-Type", "application/json").json(t)
	dep := fmt.Sprintf("/v1/accounts/%d/deposits", int(acct["id"].(float64)))
	const key = "logs-secret-key-7f3a"
	logged.call("POST", dep, token, key, `{"amount":1}`, "Content-Type", "application/json")
	r := logged.call("POST", dep, token, key, `{"amount":2}`, "Content-Type", "application/json", "X-Request-Id", "req-422")
	if r.status != 422 {
		t.Fatalf("reuse: %d %s", r.status, r.body)
	}
	if err := logged.shutdown(); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(log.String(), key) {
		t.Fatalf("the key is in the log:\n%s", log.String())
	}
	lines, _ := logsLines(log.String())
	found := false
	for _, l := range lines {
		if l["state"] == "key_reused" {
			found = true
			kh, _ := l["key_hash"].(string)
			if l["request_id"] != "req-422" || l["action"] != "POST /v1/accounts/{id}/deposits" || len(kh) != 12 {
				t.Errorf("the keyed line lacks a documented field: %v", l)
			}
		}
	}
	if !found {
		t.Fatalf("no key_reused line:\n%s", log.String())
	}
}

// TestLogsOutageRate: the database is unreachable for 10 s under a serving server with the
// in-process cleanup (its shortest interval, 1 s) and the receipts' River client; a client
// sends a request a second. Count the log lines per second the outage causes, by component:
// a loop that logs each failure of a tight retry floods the operator's channel.
func TestLogsOutageRate(t *testing.T) {
	t.Parallel()
	bin := serverBinary(t)
	s := startServer(t, nil)
	_, token := s.principal("logs-outage")
	receiver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(200) }))
	defer receiver.Close()
	proxy := dbProxy(t)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	log := &logsBuf{}
	cmd := exec.Command(bin, "serve")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+pgtest.Via(t, s.db, proxy.Listen), "LISTEN_ADDR="+addr,
		"CLEANUP_INTERVAL=1s", "RECEIPT_URL="+receiver.URL, "LOG_LEVEL=info")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Signal(syscall.SIGKILL); _ = cmd.Wait() }()
	up := false
	for i := 0; i < 1000 && !up; i++ {
		if res, err := http.Get("http://" + addr + "/healthz"); err == nil {
			res.Body.Close()
			up = true
		} else {
			time.Sleep(10 * time.Millisecond)
		}
	}
	if !up {
		t.Fatalf("the server did not come up:\n%s", log.String())
	}
	acct := pgtest.Send
	_, _, body := acct(t, context.Background(), "POST", "http://"+addr+"/v1/accounts", `{"name":"a","currency":"EUR"}`,
		"Authorization", "Bearer "+token, "Content-Type", "application/json")
	var a map[string]any
	_ = json.Unmarshal([]byte(body), &a)
	id, _ := a["id"].(float64)
	time.Sleep(2 * time.Second)

	before := log.Len()
	proxy.Stop()
	outage := 10 * time.Second
	end := time.Now().Add(outage)
	for i := 0; time.Now().Before(end); i++ {
		cctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		pgtest.Send(t, cctx, "POST", fmt.Sprintf("http://%s/v1/accounts/%d/deposits", addr, int(id)), `{"amount":1}`,
			"Authorization", "Bearer "+token, "Idempotency-Key", fmt.Sprintf("o%d", i), "Content-Type", "application/json")
		cancel()
		time.Sleep(time.Second)
	}
	during := log.String()[before:]
	if err := proxy.Start(); err != nil {
		t.Fatal(err)
	}
	mid := log.Len()
	time.Sleep(8 * time.Second)
	after := log.String()[mid:]
	// The server has recovered: a deposit goes through again.
	recovered := false
	for i := 0; i < 20 && !recovered; i++ {
		cctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		st, _, _ := pgtest.Send(t, cctx, "POST", fmt.Sprintf("http://%s/v1/accounts/%d/deposits", addr, int(id)), `{"amount":1}`,
			"Authorization", "Bearer "+token, "Idempotency-Key", fmt.Sprintf("r%d", i), "Content-Type", "application/json")
		cancel()
		recovered = st == 201
		if !recovered {
			time.Sleep(500 * time.Millisecond)
		}
	}
	if !recovered {
		t.Errorf("the server did not recover after the outage:\n%s", log.String()[mid:])
	}

	count := func(s string) (total int, by map[string]int) {
		by = map[string]int{}
		lines, notJSON := logsLines(s)
		for _, l := range lines {
			comp, _ := l["component"].(string)
			msg, _ := l["msg"].(string)
			if len(msg) > 60 {
				msg = msg[:60]
			}
			by[fmt.Sprintf("%s %s [%s]", l["level"], msg, comp)]++
		}
		for _, l := range notJSON {
			if len(l) > 60 {
				l = l[:60]
			}
			by["NOT JSON "+l]++
		}
		return len(lines) + len(notJSON), by
	}
	total, by := count(during)
	t.Logf("during the %s outage: %d lines (%.1f/s), %d bytes", outage, total, float64(total)/outage.Seconds(), len(during))
	for k, v := range by {
		t.Logf("  %4d  %s", v, k)
	}
	atotal, aby := count(after)
	t.Logf("in the 8 s after it: %d lines", atotal)
	for k, v := range aby {
		t.Logf("  %4d  %s", v, k)
	}
	// Per second of outage: a request line and its error (the client's own request), a cleanup
	// pass, and what River's client says: more than 10 lines a second is a flood.
	if rate := float64(total) / outage.Seconds(); rate > 10 {
		t.Errorf("a 10 s outage logged %d lines (%.1f a second, %d bytes)", total, rate, len(during))
	}
}

// TestLogsLeaseRouteClientMistakesNotWarnings: the same on the lease route POST /v1/payouts
// (its work outlives its client): a client that leaves while its payout runs, a duplicate that
// gives up or is told 409, a key reused for another amount, a payout of a large amount. None is
// the operator's to act on: nothing at WARN or ERROR.
func TestLogsLeaseRouteClientMistakesNotWarnings(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	log := &logsBuf{}
	logged := serveWith(t, s.db, s.db, map[string]string{"PAYOUT_PROVIDER_DELAY": "1500ms"}, log)
	_, token := s.principal("logs-payouts")
	acct := logged.call("POST", "/v1/accounts", token, "", `{"name":"a","currency":"EUR"}`, "Content-Type", "application/json").json(t)
	id := int(acct["id"].(float64))
	if r := logged.call("POST", fmt.Sprintf("/v1/accounts/%d/deposits", id), token, "", `{"amount":1000}`, "Content-Type", "application/json"); r.status != 201 {
		t.Fatalf("deposit: %d %s", r.status, r.body)
	}
	body := fmt.Sprintf(`{"account":%d,"amount":100}`, id)
	send := func(timeout time.Duration, key, body string) int {
		cctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		st, _, _ := pgtest.Send(t, cctx, "POST", logged.url+"/v1/payouts", body, "Authorization", "Bearer "+token,
			"Idempotency-Key", key, "Content-Type", "application/json")
		return st
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); send(300*time.Millisecond, "P", body) }() // leaves while its payout runs
	time.Sleep(100 * time.Millisecond)
	t.Logf("duplicate that gives up: %d", send(300*time.Millisecond, "P", body))
	t.Logf("key reused: %d", send(5*time.Second, "P", fmt.Sprintf(`{"account":%d,"amount":101}`, id)))
	t.Logf("large amount: %d", send(10*time.Second, "Q", fmt.Sprintf(`{"account":%d,"amount":999999}`, id)))
	t.Logf("malformed: %d", send(5*time.Second, "R", `{"account":`))
	wg.Wait()
	time.Sleep(2500 * time.Millisecond) // the payout that lost its client finishes
	t.Logf("the retry after: %d", send(10*time.Second, "P", body))
	if err := logged.shutdown(); err != nil {
		t.Fatal(err)
	}
	lines, notJSON := logsLines(log.String())
	if len(notJSON) > 0 {
		t.Errorf("log lines that are not JSON: %q", notJSON)
	}
	for _, l := range lines {
		if lv, _ := l["level"].(string); lv == "WARN" || lv == "ERROR" {
			b, _ := json.Marshal(l)
			t.Errorf("a client's mistake logged at %s: %s", lv, b)
		}
	}
	if t.Failed() || testing.Verbose() {
		t.Logf("log:\n%s", log.String())
	}
}
