package main

// Tests from a mutation review (D235): each failed with a single-point change of the code that the
// rest of the suite let pass; its comment names the promise it keeps.

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestWaitingBytesBoundary: docs/operations.md, IDEMPOTENCY_MAX_WAITING_BYTES: "at least
// `MAX_BODY_BYTES` + 4096". One byte below that is refused, naming the variable; that value itself
// is taken.
func TestWaitingBytesBoundary(t *testing.T) {
	const body = 1 << 20
	for _, c := range []struct {
		waiting int64
		ok      bool
	}{{body + 4095, false}, {body + 4096, true}, {body, false}} {
		m := NewMain(io.Discard, io.Discard)
		err := m.ParseFlags(nil, func(k string) string {
			switch k {
			case "IDEMPOTENCY_MAX_WAITING_BYTES":
				return strconv.FormatInt(c.waiting, 10)
			case "MAX_BODY_BYTES":
				return strconv.Itoa(body)
			}
			return ""
		})
		if c.ok && (err != nil || m.Config.MaxWaitingBytes != c.waiting) {
			t.Errorf("IDEMPOTENCY_MAX_WAITING_BYTES=%d with MAX_BODY_BYTES=%d: %v (config %d), want it taken", c.waiting, body, err, m.Config.MaxWaitingBytes)
		}
		if !c.ok && (err == nil || !strings.Contains(err.Error(), "IDEMPOTENCY_MAX_WAITING_BYTES")) {
			t.Errorf("IDEMPOTENCY_MAX_WAITING_BYTES=%d with MAX_BODY_BYTES=%d: %v, want it refused (at least MAX_BODY_BYTES + 4096)", c.waiting, body, err)
		}
	}
}

// recordBatches makes every DELETE on the key table that deletes rows record how many it
// deleted (one cleanup batch is one DELETE: idem_cleanup), and take at least sleep seconds, so
// that a batch's duration, and the pause CLEANUP_DUTY sets after it, are known.
func recordBatches(t *testing.T, s *testServer, sleep float64) {
	t.Helper()
	pgtest.Exec(t, s.pool, `CREATE TABLE public.cleanup_batches (n int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	pgtest.Exec(t, s.pool, fmt.Sprintf(`CREATE FUNCTION public.record_cleanup_batch() RETURNS trigger LANGUAGE plpgsql AS $$
		DECLARE n int;
		BEGIN
			SELECT count(*) INTO n FROM deleted_rows;
			IF n > 0 THEN
				INSERT INTO public.cleanup_batches (n) VALUES (n);
				PERFORM pg_sleep(%g);
			END IF;
			RETURN NULL;
		END $$`, sleep))
	pgtest.Exec(t, s.pool, `CREATE TRIGGER record_cleanup_batch AFTER DELETE ON idem.idempotency_keys
		REFERENCING OLD TABLE AS deleted_rows FOR EACH STATEMENT EXECUTE FUNCTION public.record_cleanup_batch()`)
}

// TestScheduledCleanupSettings: docs/operations.md, "Configuration": CLEANUP_BATCH_SIZE is the
// "rows per cleanup batch (each batch its own transaction)", and CLEANUP_DUTY "the share of the
// time the scheduled cleaner's batches may take ...: after each batch it pauses so that batches
// take at most this share of a pass". The server's scheduled cleaner uses both: with a batch of 10
// and a duty of 0.01, 30 expired keys go 10 at a time, and after a batch that took 50 ms the next
// one waits about 5 s.
func TestScheduledCleanupSettings(t *testing.T) {
	t.Parallel()
	s := startServer(t, map[string]string{"CLEANUP_INTERVAL": "1s", "CLEANUP_BATCH_SIZE": "10", "CLEANUP_DUTY": "0.01"})
	recordBatches(t, s, 0.05)
	id, _ := s.principal("cleanup-settings")
	pgtest.InsertExpired(t, s.pool, id, 30)
	pgtest.WaitFor(t, s.pool, `SELECT count(*) FROM public.cleanup_batches`)
	time.Sleep(1500 * time.Millisecond) // far less than the pause a duty of 0.01 sets after a 50 ms batch
	if n := s.count(`SELECT count(*) FROM public.cleanup_batches WHERE n > 10`); n != 0 {
		t.Errorf("%d cleanup batches deleted more than CLEANUP_BATCH_SIZE=10 keys", n)
	}
	if n := s.count(`SELECT count(*) FROM public.cleanup_batches`); n != 1 {
		t.Errorf("%d batches within 1.5 s of the first, which took 50 ms: CLEANUP_DUTY=0.01 pauses about 5 s after it", n)
	}
	if left := s.count(`SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = $1`, id); left != 20 {
		t.Errorf("%d of the 30 expired keys left after one batch of 10, want 20", left)
	}
}

// TestCleanupCommandBatchSize: `server cleanup` runs its pass in batches of CLEANUP_BATCH_SIZE
// ("rows per cleanup batch (each batch its own transaction)", docs/operations.md): 20 expired keys
// at 7 a batch are 7, 7 and 6.
func TestCleanupCommandBatchSize(t *testing.T) {
	t.Parallel()
	s := startServer(t, nil)
	recordBatches(t, s, 0)
	id, _ := s.principal("cleanup-command")
	pgtest.InsertExpired(t, s.pool, id, 20)
	var out bytes.Buffer
	m := NewMain(&out, io.Discard)
	if err := m.ParseFlags([]string{"cleanup"}, serverEnv(s.db, map[string]string{"CLEANUP_BATCH_SIZE": "7"})); err != nil {
		t.Fatal(err)
	}
	err := m.Run(context.Background())
	_ = m.Close()
	if err != nil || !strings.HasPrefix(out.String(), "deleted 20 expired keys") {
		t.Fatalf("server cleanup: %v, %q", err, out.String())
	}
	var sizes []string
	rows, err := s.pool.Query(context.Background(), `SELECT n FROM public.cleanup_batches ORDER BY at`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var n int
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, strconv.Itoa(n))
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if got := strings.Join(sizes, ","); got != "7,7,6" {
		t.Errorf("server cleanup with CLEANUP_BATCH_SIZE=7 deleted 20 keys in batches of %s, want 7,7,6", got)
	}
}

// TestTakeoverBesideOneClient: docs/operations.md, "a `serve` that finds the cluster running after
// the server that started it was killed ... takes it over and stops it on exit, unless another
// client still uses it". One client (a single connection, as a psql session) is another client: the
// serve that finds it leaves the cluster running on exit.
func TestTakeoverBesideOneClient(t *testing.T) {
	t.Parallel()
	d := toNewData(t)
	a := d.serve(t)
	a.kill9()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, d.cl.ConnString("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	c := d.serve(t)
	c.interrupt(t)
	time.Sleep(500 * time.Millisecond)
	if _, err := conn.Exec(ctx, `SELECT 1`); err != nil || !d.listening() {
		t.Errorf("one client still used the private cluster, but the serve that started after the kill -9 took it over and its Ctrl-C stopped it: %v\n%s", err, c.out.String())
	}
}

// TestRequestLogReplayedAndPathBound: docs/operations.md, "Logs": "Every request logs one line with
// its correlation id ..., method and path (their first 32 and 1,024 bytes: a longer one is cut and
// ends in `...`), status ..., whether it was replayed and its duration". A replay logs
// "replayed":true; a path of exactly 1,024 bytes is logged whole, one of 1,025 cut to 1,024 and
// "...".
func TestRequestLogReplayedAndPathBound(t *testing.T) {
	t.Parallel()
	var log opsBuf
	db := migratedAsOwner(t)
	s := serveWith(t, db, db, nil, &log)
	_, token := s.principal("log-lines")
	body := `{"name":"a","currency":"EUR"}`
	if r := s.call("POST", "/v1/accounts", token, "log-key", body, "X-Request-Id", "log-first"); r.status != 201 {
		t.Fatalf("account: %+v", r)
	}
	if r := s.call("POST", "/v1/accounts", token, "log-key", body, "X-Request-Id", "log-replay"); r.status != 201 || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("the repeat: %+v, want the 201 replayed", r)
	}
	exact := "/" + strings.Repeat("a", 1023)
	longer := "/" + strings.Repeat("b", 1024)
	s.call("GET", exact, "", "", "", "X-Request-Id", "log-exact")
	s.call("GET", longer, "", "", "", "X-Request-Id", "log-longer")
	time.Sleep(100 * time.Millisecond)
	out := log.String()
	line := func(id string) string {
		return regexp.MustCompile(`(?m)^.*"msg":"request".*"request_id":"` + id + `".*$`).FindString(out)
	}
	if l := line("log-first"); !strings.Contains(l, `"replayed":false`) {
		t.Errorf("the first request's line: %q, want \"replayed\":false", l)
	}
	if l := line("log-replay"); !strings.Contains(l, `"replayed":true`) {
		t.Errorf("the replay's line: %q, want \"replayed\":true", l)
	}
	if l := line("log-exact"); !strings.Contains(l, `"path":"`+exact+`"`) {
		t.Errorf("a path of 1,024 bytes was not logged whole: %q", l)
	}
	if l := line("log-longer"); !strings.Contains(l, `"path":"`+longer[:1024]+`..."`) {
		t.Errorf("a path of 1,025 bytes was not logged as its first 1,024 and ...: %q", l)
	}
}
