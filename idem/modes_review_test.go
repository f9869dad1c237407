package idem_test

// An adversarial review (helper session) of pgx's query exec modes and a legacy login role's
// session settings (D231) at every entry point session_settings_test.go does not reach: a
// lease route with steps and a takeover, DoLease with steps, the Gate's duplicate waiting,
// MarkOneTimeSecret, a replay of a large body, the operators' reads and ReleaseStuck, the
// cleanup (Cleaner with its VACUUM decision, Cleanup, CleanupPaced), in all five modes. Every
// entry point answered alike; what it found is in D232 (client_encoding) and below.

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

var modesAll = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeDescribeExec,
	pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// modesLegacy is legacyRoleSettings without standard_conforming_strings = off, which pgx's
// simple protocol refuses before it sends anything ("simple protocol queries must be run with
// standard_conforming_strings=on"; docs/operations.md prefers exec mode behind PgBouncer).
var modesLegacy = []string{
	"DateStyle = 'SQL, DMY'", "bytea_output = 'escape'", "IntervalStyle = 'sql_standard'",
	"extra_float_digits = -15", "TimeZone = 'Asia/Kathmandu'",
}

type modesEnv struct {
	app, op, owner *pgxpool.Pool
	admin          *pgx.Conn
}

// modesPools gives pools in mode of an idem_app login role, an idem_operator login role and
// the database's owner (the test's role), after ALTER ROLE ... SET of sets on both login roles
// and ALTER DATABASE ... SET of sets (which reaches the owner's sessions too).
func modesPools(t *testing.T, mode pgx.QueryExecMode, sets []string) modesEnv {
	t.Helper()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	opURL := pgtest.LoginRole(t, db, "idem_operator")
	admin := pgtest.Connect(t, db)
	var name string
	if err := admin.QueryRow(context.Background(), `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	for _, s := range sets {
		pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, appURL)+` SET `+s)
		pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, opURL)+` SET `+s)
		pgtest.Exec(t, admin, `ALTER DATABASE "`+name+`" SET `+s)
	}
	mk := func(url string) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.ConnConfig.DefaultQueryExecMode = mode
		cfg.MaxConns = 8
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	return modesEnv{app: mk(appURL), op: mk(opURL), owner: mk(db), admin: admin}
}

type modesCleanObs struct {
	vacuums atomic.Int32
	mu      sync.Mutex
	results []idem.PassResult
}

func (o *modesCleanObs) PassEnded(r idem.PassResult, _ int, _ time.Duration) {
	o.mu.Lock()
	o.results = append(o.results, r)
	o.mu.Unlock()
}
func (o *modesCleanObs) Vacuumed() { o.vacuums.Add(1) }

func modesNear(a, b time.Time, d time.Duration) bool {
	diff := a.Sub(b)
	return diff < d && diff > -d
}

// TestEveryEntryPointInEveryQueryMode runs every entry point in every mode under a legacy
// role's (and database's) settings. Each entry point must give the answer the
// default mode gives: no error, the first answer on every repeat, times and durations as the
// database holds them.
func TestEveryEntryPointInEveryQueryMode(t *testing.T) {
	t.Parallel()
	// the legacy settings only: the default ones run in the default mode all over the suite, and
	// every mode's statements are the same under both
	for _, mode := range modesAll {
		t.Run(mode.String()+"/legacy", func(t *testing.T) {
			t.Parallel()
			modesRun(t, modesPools(t, mode, modesLegacy), true)
		})
	}
}

func modesRun(t *testing.T, env modesEnv, legacy bool) {
	ctx := context.Background()
	if legacy {
		var style, out string
		if err := env.app.QueryRow(ctx, `SELECT current_setting('DateStyle'), current_setting('bytea_output')`).Scan(&style, &out); err != nil || style != "SQL, DMY" || out != "escape" {
			t.Fatalf("the role's settings: %q %q %v", style, out, err)
		}
		if err := env.owner.QueryRow(ctx, `SELECT current_setting('DateStyle')`).Scan(&style); err != nil || style != "SQL, DMY" {
			t.Fatalf("the owner's settings: %q %v", style, err)
		}
	}

	t.Run("lease route with steps and a takeover", func(t *testing.T) {
		m := quietMiddleware(t, idem.Options{DB: env.app})
		every := make([]byte, 256)
		for i := range every {
			every[i] = byte(i)
		}
		type saved struct {
			ID   int       `json:"id"`
			Note string    `json:"note"`
			At   time.Time `json:"at"`
			Blob []byte    `json:"blob"`
		}
		at := time.Date(2024, 3, 5, 1, 2, 3, 4000, time.UTC)
		var attempts, oneRuns, twoRuns atomic.Int32
		var points []string
		var mu sync.Mutex
		h := m.Route(idem.Route{Action: "POST /pay", Required: true, Lease: 10 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := attempts.Add(1)
			ci, _ := idem.ClaimOf(r.Context())
			mu.Lock()
			points = append(points, ci.RecoveryPoint)
			mu.Unlock()
			one, err := idem.Step(r.Context(), "one", func(ctx context.Context, tx pgx.Tx) (saved, error) {
				oneRuns.Add(1)
				var x int
				if err := tx.QueryRow(ctx, `SELECT 41 + 1`).Scan(&x); err != nil {
					return saved{}, err
				}
				return saved{ID: x, Note: `n\u00e9 \ "q" \x00`, At: at, Blob: every}, nil
			})
			if err != nil {
				http.Error(w, "step one: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
			if n == 1 {
				http.Error(w, "provider down", http.StatusBadGateway) // gives the lease up
				return
			}
			two, err := idem.Step(r.Context(), "two", func(ctx context.Context, tx pgx.Tx) (int, error) {
				twoRuns.Add(1)
				return one.ID * 2, nil
			})
			if err != nil {
				http.Error(w, "step two: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
			if one.ID != 42 || !one.At.Equal(at) || !bytes.Equal(one.Blob, every) || one.Note != `n\u00e9 \ "q" \x00` {
				http.Error(w, fmt.Sprintf("step one's saved value came back as %+v", one), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Set("Location", fmt.Sprint("/pay/", two))
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write(every)
		}))
		srv := httptest.NewServer(h)
		defer srv.Close()
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", `{"amount":1}`, "Idempotency-Key", "lease-steps")
		if st != http.StatusBadGateway {
			t.Fatalf("first attempt: %d %q; want 502", st, body)
		}
		for i := 0; i < 2; i++ {
			st, hd, body := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", `{"amount":1}`, "Idempotency-Key", "lease-steps")
			if st != http.StatusCreated || !bytes.Equal([]byte(body), every) || hd.Get("Location") != "/pay/84" {
				t.Errorf("attempt %d: %d Location=%q %d bytes %q; want 201, Location /pay/84, the 256 byte values", i+2, st, hd.Get("Location"), len(body), trunc(body))
			}
			if i == 1 && hd.Get("Idempotent-Replayed") != "true" {
				t.Errorf("the third request was not a replay: %v", hd)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if attempts.Load() != 2 || oneRuns.Load() != 1 || twoRuns.Load() != 1 || len(points) != 2 || points[1] != "one" {
			t.Errorf("handler ran %d times, step one %d, step two %d, recovery points %q; want 2, 1, 1 and [\"\" \"one\"]",
				attempts.Load(), oneRuns.Load(), twoRuns.Load(), points)
		}
		story, ok, err := idem.ReadKey(ctx, env.app, "alice", "lease-steps")
		if err != nil || !ok || story.State != "completed" || story.Status != 201 || story.BodyBytes != 256 ||
			!modesNear(story.KeptUntil, time.Now().Add(24*time.Hour), time.Minute) || story.ClaimedAt.IsZero() ||
			!modesNear(story.ClaimedAt, time.Now(), time.Minute) {
			t.Errorf("ReadKey of the lease route's key: %+v %v %v; want completed, 201, 256 bytes, kept 24 h, claimed just now", story, ok, err)
		}
	})

	t.Run("DoLease with steps and a retry after a failure", func(t *testing.T) {
		job := idem.Job{Principal: "p", Key: "dolease-steps", Action: "a", Input: map[string]any{"x": []byte{0, 1, 255}}, Lease: 5 * time.Second}
		var runs, stepRuns atomic.Int32
		var points []string
		fn := func(ctx context.Context, c idem.LeaseClaim) (string, error) {
			n := runs.Add(1)
			points = append(points, c.RecoveryPoint)
			v, err := idem.Step(ctx, "s1", func(ctx context.Context, tx pgx.Tx) (map[string]any, error) {
				stepRuns.Add(1)
				return map[string]any{"k": "v\\x", "n": 1.5, "null": nil}, nil
			})
			if err != nil {
				return "", err
			}
			if n == 1 {
				return "", errors.New("fails once")
			}
			return fmt.Sprint(v), nil
		}
		if _, _, err := idem.DoLease(ctx, env.app, job, fn); err == nil || err.Error() != "fails once" {
			t.Fatalf("first DoLease: %v; want fails once", err)
		}
		r2, rep2, err := idem.DoLease(ctx, env.app, job, fn)
		r3, rep3, err3 := idem.DoLease(ctx, env.app, job, fn)
		want := "map[k:v\\x n:1.5 null:<nil>]"
		if err != nil || rep2 || r2 != want || err3 != nil || !rep3 || r3 != want || runs.Load() != 2 || stepRuns.Load() != 1 ||
			len(points) != 2 || points[1] != "s1" {
			t.Errorf("DoLease after the failure: %q %v %v; the repeat %q %v %v; fn ran %d, the step %d, points %q; want %q, then replayed, 2, 1, [\"\" \"s1\"]",
				r2, rep2, err, r3, rep3, err3, runs.Load(), stepRuns.Load(), points, want)
		}
	})

	t.Run("the Gate's duplicate waits for the first and replays it", func(t *testing.T) {
		g := idem.NewGate(idem.GateOptions{})
		job := idem.Job{Principal: "p", Key: "gate-1", Action: "a", Input: "same", Gate: g}
		release := make(chan struct{})
		started := make(chan struct{})
		var runs atomic.Int32
		fn := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if runs.Add(1) == 1 {
				close(started)
				<-release
			}
			var n int
			err := tx.QueryRow(ctx, `SELECT 255`).Scan(&n)
			return []byte{0, byte(n), '\\'}, err
		}
		type res struct {
			v   []byte
			rep bool
			err error
		}
		first := make(chan res, 1)
		go func() {
			v, rep, err := idem.Do(ctx, env.app, job, idem.TxOptions{}, fn)
			first <- res{v, rep, err}
		}()
		<-started
		second := make(chan res, 1)
		go func() {
			v, rep, err := idem.Do(ctx, env.app, job, idem.TxOptions{}, fn)
			second <- res{v, rep, err}
		}()
		deadline := time.Now().Add(10 * time.Second)
		for g.Stats().Waiting+int64(g.Stats().Coalesced) == 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		close(release)
		a, b := <-first, <-second
		want := []byte{0, 0xff, 0x5c}
		if a.err != nil || a.rep || !bytes.Equal(a.v, want) || b.err != nil || !b.rep || !bytes.Equal(b.v, want) || runs.Load() != 1 {
			t.Errorf("two Do at once: first %v %v %v, second %v %v %v, fn ran %d; want %v, the second replayed, fn once (gate %+v)",
				a.v, a.rep, a.err, b.v, b.rep, b.err, runs.Load(), want, g.Stats())
		}
	})

	t.Run("a route's duplicate waits for the first and replays it", func(t *testing.T) {
		m := quietMiddleware(t, idem.Options{DB: env.app})
		release := make(chan struct{})
		started := make(chan struct{})
		var runs atomic.Int32
		h := m.Route(idem.Route{Action: "POST /dup", Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				close(started)
				<-release
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte{0, 1, '\\', 0xff})
		}))
		srv := httptest.NewServer(h)
		defer srv.Close()
		type res struct {
			st   int
			hd   http.Header
			body string
		}
		first, second := make(chan res, 1), make(chan res, 1)
		go func() {
			st, hd, body := pgtest.Send(t, ctx, "POST", srv.URL+"/dup", `{"a":1}`, "Idempotency-Key", "dup-1")
			first <- res{st, hd, body}
		}()
		<-started
		go func() {
			st, hd, body := pgtest.Send(t, ctx, "POST", srv.URL+"/dup", `{"a":1}`, "Idempotency-Key", "dup-1")
			second <- res{st, hd, body}
		}()
		deadline := time.Now().Add(10 * time.Second)
		for m.GateStats().Waiting+int64(m.GateStats().Coalesced) == 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		close(release)
		a, b := <-first, <-second
		want := string([]byte{0, 1, '\\', 0xff})
		if a.st != 201 || a.body != want || b.st != 201 || b.body != want || b.hd.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
			t.Errorf("two requests at once: %d %q, %d %q %v, handler ran %d; want both 201 %q, the second replayed", a.st, a.body, b.st, trunc(b.body), b.hd, runs.Load(), want)
		}
	})

	t.Run("a lease route's duplicate waits for the lease's answer and replays it", func(t *testing.T) {
		m := quietMiddleware(t, idem.Options{DB: env.app})
		release := make(chan struct{})
		started := make(chan struct{})
		var runs atomic.Int32
		h := m.Route(idem.Route{Action: "POST /ldup", Required: true, Lease: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				close(started)
				<-release
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte{0, 1, '\\', 0xff})
		}))
		srv := httptest.NewServer(h)
		defer srv.Close()
		type res struct {
			st   int
			hd   http.Header
			body string
		}
		first, second := make(chan res, 1), make(chan res, 1)
		go func() {
			st, hd, body := pgtest.Send(t, ctx, "POST", srv.URL+"/ldup", `{"a":1}`, "Idempotency-Key", "ldup-1")
			first <- res{st, hd, body}
		}()
		<-started
		go func() {
			st, hd, body := pgtest.Send(t, ctx, "POST", srv.URL+"/ldup", `{"a":1}`, "Idempotency-Key", "ldup-1")
			second <- res{st, hd, body}
		}()
		deadline := time.Now().Add(10 * time.Second)
		for m.GateStats().Waiting == 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		waited := m.GateStats().Waiting
		time.Sleep(300 * time.Millisecond) // a few of the looks (every 100 ms or so) see the lease held
		close(release)
		a, b := <-first, <-second
		want := string([]byte{0, 1, '\\', 0xff})
		if waited != 1 || a.st != 201 || a.body != want || b.st != 201 || b.body != want || b.hd.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
			t.Errorf("two lease requests at once (waiting %d): %d %q, %d %q %v, handler ran %d; want both 201 %q, the second replayed",
				waited, a.st, a.body, b.st, trunc(b.body), b.hd, runs.Load(), want)
		}
	})

	t.Run("MarkOneTimeSecret", func(t *testing.T) {
		m := quietMiddleware(t, idem.Options{DB: env.app})
		h := m.Route(idem.Route{Action: "POST /tokens", Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			idem.MarkOneTimeSecret(r.Context())
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte("tok_secret"))
		}))
		srv := httptest.NewServer(h)
		defer srv.Close()
		st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/tokens", `{}`, "Idempotency-Key", "secret-1")
		if st != 201 || body != "tok_secret" {
			t.Errorf("first: %d %q", st, body)
		}
		st, _, body = pgtest.Send(t, ctx, "POST", srv.URL+"/tokens", `{}`, "Idempotency-Key", "secret-1")
		if st != http.StatusConflict || !strings.Contains(body, "one_time_secret") {
			t.Errorf("repeat: %d %q; want 409 one_time_secret", st, trunc(body))
		}
		story, ok, err := idem.ReadKey(ctx, env.app, "alice", "secret-1")
		if err != nil || !ok || story.Withheld != idem.WithheldOneTimeSecret || story.BodyBytes != 0 {
			t.Errorf("ReadKey: %+v %v %v; want withheld one_time_secret, no body", story, ok, err)
		}
	})

	t.Run("replay of a 4 MiB body", func(t *testing.T) {
		big := make([]byte, 4<<20)
		_, _ = rand.Read(big)
		copy(big, `\\x\000`) // bytes that look like bytea text
		m := quietMiddleware(t, idem.Options{DB: env.app, MaxStoredBodyBytes: 8 << 20})
		var runs atomic.Int32
		h := m.Route(idem.Route{Action: "POST /big", Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(big)
		}))
		srv := httptest.NewServer(h)
		defer srv.Close()
		for i := 0; i < 2; i++ {
			st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/big", `{}`, "Idempotency-Key", "big-1")
			if st != 200 || !bytes.Equal([]byte(body), big) || runs.Load() != 1 {
				t.Errorf("request %d: %d, %d bytes (equal %v), handler ran %d; want 200 and the same 4 MiB", i+1, st, len(body), bytes.Equal([]byte(body), big), runs.Load())
			}
		}
	})

	t.Run("operators: ReadStuck, ReadHealth, ReadSummary, ReleaseStuck", func(t *testing.T) {
		before := time.Now()
		d, err := idem.Begin(ctx, env.app, idem.Claim{Principal: "p", Key: "stuck-1", Action: "a", Lease: 90 * time.Minute})
		if err != nil || d.Outcome != idem.Claimed {
			t.Fatalf("Begin: %+v %v", d, err)
		}
		after := time.Now()
		// The same claim, a second Begin: in progress, retry after about the lease.
		d2, err := idem.Begin(ctx, env.app, idem.Claim{Principal: "p", Key: "stuck-1", Action: "a", Lease: 90 * time.Minute})
		if err != nil || d2.Outcome != idem.InProgress || d2.RetryAfter < 89*time.Minute || d2.RetryAfter > 90*time.Minute {
			t.Errorf("Begin of the held key: %v retry after %v, %v; want in_progress, about 90 minutes", d2.Outcome, d2.RetryAfter, err)
		}
		// A transactional claim of the held key in RunTx (BeginRecordSQL in the binary modes,
		// BeginSQL in the others): in progress, the same retry after.
		var d4 idem.Decision
		err = idem.RunTx(ctx, env.app, idem.TxOptions{MaxAttempts: 1}, func(tx *idem.Tx) error {
			var err error
			d4, err = tx.Claim(ctx, idem.Claim{Principal: "p", Key: "stuck-1", Action: "a"})
			return err
		})
		if d4.Outcome != idem.InProgress || d4.RetryAfter < 89*time.Minute || d4.RetryAfter > 90*time.Minute || d4.ProviderKey != d.ProviderKey || d4.Attempt != d.Attempt {
			t.Errorf("Tx.Claim of the held key: %+v %v; want in_progress, about 90 minutes, attempt %d", d4, err, d.Attempt)
		}
		stuck, err := idem.ReadStuck(ctx, env.op, 0, 10)
		if err != nil || len(stuck) != 1 {
			t.Fatalf("ReadStuck: %+v %v", stuck, err)
		}
		s := stuck[0]
		if s.Key != "stuck-1" || s.Attempt != d.Attempt || s.ProviderKey != d.ProviderKey ||
			s.ClaimedAt.Before(before.Add(-time.Second)) || s.ClaimedAt.After(after.Add(time.Second)) ||
			s.LeaseExpiresAt.Sub(s.ClaimedAt) != 90*time.Minute || s.LeaseRunOut || s.Age < 0 || s.Age > 10*time.Second {
			t.Errorf("ReadStuck: %+v; want the claim of attempt %d, claimed between %v and %v, lease 90 minutes after, age under 10 s",
				s, d.Attempt, before, after)
		}
		h, err := idem.ReadHealth(ctx, env.op)
		if err != nil || h.InProgress != 1 || !h.OldestInProgress.Equal(s.ClaimedAt) || h.OldestAge < 0 || h.OldestAge > 10*time.Second {
			t.Errorf("ReadHealth: %+v %v; want 1 in progress, the oldest at %v", h, err, s.ClaimedAt)
		}
		sum, err := idem.ReadSummary(ctx, env.op, true)
		if err != nil || len(sum) == 0 {
			t.Fatalf("ReadSummary: %+v %v", sum, err)
		}
		var found bool
		for _, r := range sum {
			if r.Principal == "p" {
				found = true
				if r.InProgress != 1 || !r.OldestInProgress.Equal(s.ClaimedAt) {
					t.Errorf("ReadSummary's row of p: %+v; want 1 in progress, the oldest at %v", r, s.ClaimedAt)
				}
			}
		}
		if !found {
			t.Errorf("ReadSummary: no row of p in %+v", sum)
		}
		story, ok, err := idem.ReadKey(ctx, env.op, "p", "stuck-1")
		if err != nil || !ok || !story.ClaimedAt.Equal(s.ClaimedAt) || !story.LeaseExpiresAt.Equal(s.LeaseExpiresAt) {
			t.Errorf("ReadKey: %+v %v %v; want claimed %v, lease to %v", story, ok, err, s.ClaimedAt, s.LeaseExpiresAt)
		}
		if err := idem.ReleaseStuck(ctx, env.op, "p", "stuck-1", d.Attempt, `dead worker: it's \ gone`); err != nil {
			t.Errorf("ReleaseStuck: %v", err)
		}
		// docs/sql-api.md: the claim gets a new token, loses its claim time, its lease ends; the
		// next claim takes it over in the same generation, with the same provider key.
		if story, ok, err := idem.ReadKey(ctx, env.op, "p", "stuck-1"); err != nil || !ok || story.State != "in_progress" ||
			!story.ClaimedAt.IsZero() || story.Attempt == d.Attempt || story.LeaseExpiresAt.After(time.Now().Add(time.Second)) {
			t.Errorf("ReadKey after ReleaseStuck: %+v %v %v; want in progress, no claim time, a new token, its lease ended", story, ok, err)
		}
		d3, err := idem.Begin(ctx, env.app, idem.Claim{Principal: "p", Key: "stuck-1", Action: "a", Lease: time.Minute})
		if err != nil || d3.Outcome != idem.Claimed || d3.ProviderKey != d.ProviderKey {
			t.Errorf("Begin after ReleaseStuck: %v %q %v; want claimed, provider key %q", d3.Outcome, d3.ProviderKey, err, d.ProviderKey)
		}
	})

	t.Run("cleanup: Cleaner with its VACUUM, Cleanup, CleanupPaced", func(t *testing.T) {
		pgtest.InsertExpired(t, env.admin, "old", 300)
		obs := &modesCleanObs{}
		c, err := idem.NewCleaner(env.owner, idem.CleanerOptions{Duty: 1, Metrics: obs, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		n, ran, err := c.Pass(ctx)
		if err != nil || !ran || n != 300 || obs.vacuums.Load() != 1 {
			t.Errorf("Cleaner.Pass as the owner: %d %v %v, vacuumed %d times; want 300 deleted and one VACUUM", n, ran, err, obs.vacuums.Load())
		}
		pgtest.InsertKeys(t, env.admin, "idem.idempotency_keys", "old2", "x", 7, true)
		if n, err := idem.Cleanup(ctx, env.app, 5); err != nil || n != 7 {
			t.Errorf("Cleanup as the application role: %d %v; want 7", n, err)
		}
		pgtest.InsertKeys(t, env.admin, "idem.idempotency_keys", "old3", "x", 4, true)
		if n, err := idem.CleanupPaced(ctx, env.app, 3, 0.5); err != nil || n != 4 {
			t.Errorf("CleanupPaced as the application role: %d %v; want 4", n, err)
		}
		appC, err := idem.NewCleaner(env.app, idem.CleanerOptions{Duty: 1, Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		pgtest.InsertKeys(t, env.admin, "idem.idempotency_keys", "old4", "x", 100, true)
		if n, ran, err := appC.Pass(ctx); err != nil || !ran || n != 100 {
			t.Errorf("Cleaner.Pass as the application role: %d %v %v; want 100", n, ran, err)
		}
	})

	t.Run("ReadDefaults and a heartbeat past the lease", func(t *testing.T) {
		d, err := idem.ReadDefaults(ctx, env.app)
		if err != nil || d.TTL != 24*time.Hour || d.LockTimeout != 2*time.Second || d.BatchSize != 1000 {
			t.Errorf("ReadDefaults: %+v %v", d, err)
		}
		lease := idem.Job{Principal: "p", Key: "hb-1", Action: "a", Lease: 1500 * time.Millisecond}
		v, rep, err := idem.DoLease(ctx, env.app, lease, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
			select {
			case <-ctx.Done():
				return 0, context.Cause(ctx)
			case <-time.After(2500 * time.Millisecond):
			}
			return 8, nil
		})
		if err != nil || rep || v != 8 {
			t.Errorf("DoLease past its lease: %v %v %v; want 8", v, rep, err)
		}
	})
}

func trunc(s string) string {
	if len(s) > 200 {
		return s[:200] + "..."
	}
	return s
}
