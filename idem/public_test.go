package idem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
	"github.com/pgidem/pgidem/idem/idemmigrate"
	"github.com/pgidem/pgidem/internal/dbidem"
	idemhttp "github.com/pgidem/pgidem/internal/http"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestPublicValuesAreTheImplementations: the constants of package idem, written out so that
// `go doc` shows them, are the implementation's values.
func TestPublicValuesAreTheImplementations(t *testing.T) {
	t.Parallel()
	pairs := [][2]string{
		{idem.CodeKeyMissing, idemhttp.CodeKeyMissing}, {idem.CodeKeyInvalid, idemhttp.CodeKeyInvalid},
		{idem.CodeKeyReuse, idemhttp.CodeKeyReuse}, {idem.CodeInProgress, idemhttp.CodeInProgress},
		{idem.CodeOneTimeSecret, idemhttp.CodeOneTimeSecret}, {idem.CodeNotReplayable, idemhttp.CodeNotReplayable},
		{idem.CodeRequestTooLarge, idemhttp.CodeRequestTooLarge}, {idem.CodeBodyUnreadable, idemhttp.CodeBodyUnreadable},
		{idem.CodeMalformedBody, idemhttp.CodeMalformedBody}, {idem.CodeUnsupportedMedia, idemhttp.CodeUnsupportedMedia},
		{idem.CodePrincipalUnknown, idemhttp.CodePrincipalUnknown}, {idem.CodeInternalError, idemhttp.CodeInternalError},
		{idem.CodeMisconfigured, idemhttp.CodeMisconfigured}, {idem.CodeStoreUnavailable, idemhttp.CodeStoreUnavailable},
		{idem.CodeOutcomeUnknown, idemhttp.CodeOutcomeUnknown}, {idem.CodeShuttingDown, idemhttp.CodeShuttingDown},
	}
	for _, p := range pairs {
		if p[0] != p[1] {
			t.Errorf("code %q, implementation %q", p[0], p[1])
		}
	}
	if len(idem.States()) != len(idemhttp.States) {
		t.Fatalf("%d states, implementation %d", len(idem.States()), len(idemhttp.States))
	}
	for i, s := range idem.States() {
		if string(s) != string(idemhttp.States[i]) {
			t.Errorf("state %q, implementation %q", s, idemhttp.States[i])
		}
	}
	if idem.CleanupLock != dbidem.CleanupLock || idem.DefaultCleanupDuty != dbidem.DefaultCleanupDuty ||
		idem.MinCleanupDuty != dbidem.MinCleanupDuty || idem.DefaultCleanupInterval != dbidem.DefaultCleanupInterval ||
		idem.DefaultLeaseTimeout != dbidem.DefaultLeaseTimeout || idem.MaxDuration != dbidem.MaxInterval ||
		idem.MaxLockTimeout != dbidem.MaxLockTimeout {
		t.Error("a constant differs from the implementation's")
	}
	for i, r := range idem.PassResults() {
		if string(r) != dbidem.PassResults[i] {
			t.Errorf("pass result %q, implementation %q", r, dbidem.PassResults[i])
		}
	}
	if idem.SchemaVersion() != idemmigrate.Version() {
		t.Errorf("SchemaVersion %d, the migrations bring %d", idem.SchemaVersion(), idemmigrate.Version())
	}
}

func alice(*http.Request) (string, bool) { return "alice", true }

func newPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestNewChecksTheSchema: New, StartCleaner and the first Do refuse a database whose schema
// idem is missing, older, newer or half installed, and a role that may not call the API, each
// with an error that names the fix; never a middleware that answers 503 to every request.
func TestNewChecksTheSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	want := idem.SchemaVersion()

	empty := newPool(t, pgtest.NewEmptyDB(t))
	_, err := idem.New(ctx, idem.Options{DB: empty, Principal: alice})
	var se *idem.SchemaError
	if !errors.Is(err, idem.ErrNotMigrated) || !errors.As(err, &se) || se.Schema != 0 || se.Want != want ||
		!strings.Contains(err.Error(), "idemmigrate.Migrate") || !strings.Contains(err.Error(), "owns schema idem") ||
		!strings.Contains(err.Error(), "-f sql/idem.sql") {
		t.Fatalf("New on an empty database: %v", err)
	}
	if _, err := idem.StartCleaner(ctx, empty, idem.CleanerOptions{}); !errors.Is(err, idem.ErrNotMigrated) {
		t.Fatalf("StartCleaner on an empty database: %v", err)
	}
	job := idem.Job{Principal: "p", Key: "k", Action: "a"}
	noop := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	if _, _, err := idem.Do(ctx, empty, job, idem.TxOptions{}, noop); !errors.As(err, &se) {
		t.Fatalf("Do on an empty database: %v", err)
	}

	for _, c := range []struct {
		name, sql string
		is        error
		says      string
	}{
		{"older", `UPDATE idem.schema_version SET version = version - 1`, idem.ErrNotMigrated,
			fmt.Sprintf("at version %d and this code needs version %d", want-1, want)},
		{"newer", `UPDATE idem.schema_version SET version = version + 1`, idem.ErrSchemaNewer, "upgrade github.com/pgidem/pgidem"},
		{"half installed", fmt.Sprintf(`CREATE OR REPLACE FUNCTION idem.idem_version(OUT functions_version integer, OUT schema_version integer)
			LANGUAGE sql SECURITY DEFINER AS $$ SELECT %d, (SELECT version FROM idem.schema_version) $$`, want-1), idem.ErrNotMigrated,
			"stopped half way"},
	} {
		pool, _ := pgtest.NewPool(t, 4)
		pgtest.Exec(t, pool, c.sql)
		_, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
		if !errors.Is(err, c.is) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v, want %v saying %q", c.name, err, c.is, c.says)
		}
		if err := idem.CheckSchema(ctx, pool); !errors.Is(err, c.is) {
			t.Errorf("%s: CheckSchema %v", c.name, err)
		}
	}

	// A role that is not a member of idem_app.
	db := pgtest.NewDB(t)
	stranger := newPool(t, pgtest.LoginRole(t, db, "pg_read_all_stats"))
	_, err = idem.New(ctx, idem.Options{DB: stranger, Principal: alice})
	if !errors.Is(err, idem.ErrPermissionDenied) || !strings.Contains(err.Error(), "have a superuser (or a role with ADMIN OPTION on idem_app, or CREATEROLE) run GRANT idem_app TO") {
		t.Fatalf("New as a role outside idem_app: %v", err)
	}
	app := newPool(t, pgtest.LoginRole(t, db, "idem_app"))
	if _, err := idem.New(ctx, idem.Options{DB: app, Principal: alice}); err != nil {
		t.Fatalf("New as a member of idem_app: %v", err)
	}
}

// TestNewChecksTheOptions: every option out of its bounds is refused at New (a TTL of 11
// years used to be accepted, and every request then failed); the bounds are the SQL API's
// own: a TTL of exactly MaxDuration is stored.
func TestNewChecksTheOptions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	for _, c := range []struct {
		edit func(*idem.Options)
		says string
	}{
		{func(o *idem.Options) { o.DB = nil }, "DB is required"},
		{func(o *idem.Options) { o.Principal = nil }, "Principal is required"},
		{func(o *idem.Options) { o.TTL = 11 * 365 * 24 * time.Hour }, "10 years"},
		{func(o *idem.Options) { o.TTL = idem.MaxDuration + time.Microsecond }, "10 years"},
		{func(o *idem.Options) { o.TTL = -time.Second }, "TTL"},
		{func(o *idem.Options) { o.LockTimeout = idem.MaxLockTimeout + time.Millisecond }, "lock_timeout"},
		{func(o *idem.Options) { o.LockTimeout = time.Microsecond }, "LockTimeout"},
		{func(o *idem.Options) { o.MaxBodyBytes = -1 }, "negative"},
		{func(o *idem.Options) { o.MaxAttempts = -1 }, "negative"},
		{func(o *idem.Options) { o.MaxWaitingClaims = 4 }, "smaller than the pool"},
		{func(o *idem.Options) { o.KeyHeader = "Idempotency Key" }, "not a header name"},
		{func(o *idem.Options) { o.StoredHeaders = []string{"Content-Type", "X:Y"} }, "not a header name"},
	} {
		o := idem.Options{DB: pool, Principal: alice}
		c.edit(&o)
		if _, err := idem.New(ctx, o); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("New(%+v): %v, want an error saying %q", o, err, c.says)
		}
	}
	for _, rt := range []idem.Route{{Lease: 500 * time.Millisecond}, {Lease: idem.MaxDuration + time.Second},
		{Action: strings.Repeat("a", 1001)}, {Lease: time.Second, LeaseTimeout: -1}} {
		m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice})
		if err != nil {
			t.Fatal(err)
		}
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Route(%+v) did not panic", rt)
				}
			}()
			m.Route(rt)
		}()
	}
	for _, o := range []idem.CleanerOptions{{Duty: 2}, {Duty: 0.001}, {BatchSize: -1}, {BatchSize: 2_000_000},
		{Interval: idem.MaxDuration + time.Hour}} {
		if _, err := idem.NewCleaner(pool, o); err == nil {
			t.Errorf("NewCleaner(%+v) accepted", o)
		}
	}

	// The bounds are the database's: the longest TTL New takes is stored.
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, TTL: idem.MaxDuration})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	})))
	defer srv.Close()
	if st, _, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "long"); st != 201 {
		t.Fatalf("a TTL of MaxDuration: %d %s", st, body)
	}
}

// TestReplayEdges: what the middleware promises and no other test pinned: the query string
// is not part of the fingerprint; the 409 one_time_secret of a repeat carries
// Idempotent-Replayed: true; a replay keeps the headers an outer middleware set for the
// current request (RateLimit-*), which are not stored.
func TestReplayEdges(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	var runs, limit atomic.Int32
	mux := http.NewServeMux()
	mux.Handle("POST /notes", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"run":%d}`, runs.Add(1))
	})))
	mux.Handle("POST /tokens", m.Route(idem.Route{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		idem.MarkOneTimeSecret(r.Context())
		w.WriteHeader(201)
		fmt.Fprint(w, `{"id":"t1","secret":"s3cr3t"}`)
	})))
	rateLimited := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("RateLimit", fmt.Sprintf("limit=100, remaining=%d", 100-limit.Add(1)))
		mux.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(rateLimited)
	defer srv.Close()
	post := func(path, key string) (int, http.Header, string) {
		return pgtest.Send(t, ctx, "POST", srv.URL+path, `{"text":"hi"}`, "Idempotency-Key", key, "Content-Type", "application/json")
	}

	st1, h1, b1 := post("/notes?trace=1", "q")
	st2, h2, b2 := post("/notes?trace=2&other=x", "q")
	if st1 != 201 || st2 != 201 || b2 != b1 || h2.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Fatalf("another query string: %d %s, then %d %s %v (%d runs), want the replay", st1, b1, st2, b2, h2, runs.Load())
	}
	if h1.Get("RateLimit") != "limit=100, remaining=99" || h2.Get("RateLimit") != "limit=100, remaining=98" {
		t.Fatalf("RateLimit %q then %q: the replay must carry the current request's", h1.Get("RateLimit"), h2.Get("RateLimit"))
	}

	if st, _, body := post("/tokens", "secret"); st != 201 || !strings.Contains(body, "s3cr3t") {
		t.Fatalf("the secret: %d %s", st, body)
	}
	st, h, body := post("/tokens", "secret")
	if st != 409 || !strings.Contains(body, `"code":"one_time_secret"`) || strings.Contains(body, "s3cr3t") ||
		h.Get("Idempotent-Replayed") != "true" || !strings.Contains(body, `"resource_id":"t1"`) {
		t.Fatalf("a repeat of the secret: %d %v %s", st, h, body)
	}
}

// recorder is an Observer that records the states it is told.
type recorder struct {
	mu     sync.Mutex
	states []idem.State
	during func(idem.State) // called inside Count, when set
}

func (r *recorder) Count(_ string, s idem.State) {
	if r.during != nil {
		r.during(s)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.states = append(r.states, s)
}
func (r *recorder) Done(idem.State, time.Duration)         {}
func (r *recorder) LeaseExtended(string)                   {}
func (r *recorder) LeaseEnded(string, bool, time.Duration) {}

func (r *recorder) String() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return fmt.Sprint(r.states)
}

// only tells whether the states counted are exactly these.
func (r *recorder) only(s ...idem.State) bool { return r.String() == fmt.Sprint(s) }

// TestObserverRunsOutsideTheTransaction: the observer counts a fresh claim once its
// transaction has committed: while Count(acquired) runs, another connection already sees the
// key completed, and no connection of the request is idle in a transaction. (It used to run
// inside the claim's transaction, so a slow observer held the key's row lock and a
// connection.)
func TestObserverRunsOutsideTheTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, url := pgtest.NewPool(t, 4)
	other := pgtest.Connect(t, url)
	var seen, idle atomic.Int32
	seen.Store(-1)
	rec := &recorder{}
	rec.during = func(s idem.State) {
		if s != idem.StateAcquired {
			return
		}
		var n, i int32
		_ = other.QueryRow(ctx, `SELECT count(*) FROM idem.idempotency_keys WHERE key = 'obs' AND state = 'c'`).Scan(&n)
		_ = other.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND state LIKE 'idle in transaction%'`).Scan(&i)
		seen.Store(n)
		idle.Store(i)
	}
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, Metrics: rec})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /obs"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	})))
	defer srv.Close()
	if st, _, _ := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "obs"); st != 201 {
		t.Fatal(st)
	}
	if seen.Load() != 1 || idle.Load() != 0 {
		t.Fatalf("during Count(acquired): %d completed keys visible, %d connections idle in transaction; want 1 and 0",
			seen.Load(), idle.Load())
	}
	if !rec.only(idem.StateAcquired) {
		t.Fatalf("states %v, want acquired once", rec)
	}
}

// TestLeaseRecordingFailureIsLoggedAndCounted: when a lease route's answer cannot be recorded
// (or its lease cannot be given up after a failure), the middleware logs it at error level,
// with the claim's token, and answers 503 outcome_unknown (or the handler's answer). The 503
// is counted store_error on top of acquired, as a transactional commit whose outcome is
// unknown (the dashboard's store errors and their alert see it); the lease that could not be
// given up is not (the client got the handler's answer).
func TestLeaseRecordingFailureIsLoggedAndCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	var logs bytes.Buffer
	var mu sync.Mutex
	rec := &recorder{}
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: alice, Metrics: rec,
		Logger: slog.New(slog.NewJSONHandler(lockedWriter{&mu, &logs}, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Lease: time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			var in struct {
				Break  string `json:"break"`
				Status int    `json:"status"`
			}
			if !idem.DecodeJSON(w, r, &in) {
				return
			}
			// The store fails under the work (a function gone), as a database can.
			pgtest.Exec(t, pool, `ALTER FUNCTION idem.`+in.Break+` RENAME TO `+in.Break+`_gone`)
			w.WriteHeader(in.Status)
		})))
	defer srv.Close()
	restore := func(f string) { pgtest.Exec(t, pool, `ALTER FUNCTION idem.`+f+`_gone RENAME TO `+f) }

	st, h, body := pgtest.Send(t, ctx, "POST", srv.URL, `{"break":"idem_complete","status":201}`, "Idempotency-Key", "p1")
	restore("idem_complete")
	if st != 503 || !strings.Contains(body, idem.CodeOutcomeUnknown) || h.Get("Retry-After") == "" {
		t.Fatalf("an answer that could not be recorded: %d %s", st, body)
	}
	st, _, _ = pgtest.Send(t, ctx, "POST", srv.URL, `{"break":"idem_yield","status":502}`, "Idempotency-Key", "p2")
	restore("idem_yield")
	if st != 502 {
		t.Fatalf("a failure whose lease could not be given up: %d, want the handler's 502", st)
	}
	mu.Lock()
	out := logs.String()
	mu.Unlock()
	for _, want := range []string{"lease answer not recorded", "lease not ended"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the log:\n%s", want, out)
		}
	}
	if strings.Count(out, `"level":"ERROR"`) < 2 || !strings.Contains(out, `"attempt":`) {
		t.Errorf("want both failures at error level with the claim's token:\n%s", out)
	}
	if !rec.only(idem.StateAcquired, idem.StateStoreError, idem.StateAcquired) {
		t.Fatalf("states %v, want acquired, store_error, acquired", rec)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestARoleThatLosesTheAPIIsMisconfigured: a server whose role stops being a member of
// idem_app while it runs answers 500 idempotency_misconfigured (final: no Retry-After), not
// 503.
func TestARoleThatLosesTheAPIIsMisconfigured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	app := newPool(t, appURL)
	m, err := idem.New(ctx, idem.Options{DB: app, Principal: alice, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
	})))
	defer srv.Close()
	cfg, _ := pgx.ParseConfig(appURL)
	pgtest.Exec(t, pgtest.Connect(t, db), `REVOKE idem_app FROM `+cfg.User)
	st, h, body := pgtest.Send(t, ctx, "POST", srv.URL, `{}`, "Idempotency-Key", "k")
	if st != 500 || !strings.Contains(body, idem.CodeMisconfigured) || h.Get("Retry-After") != "" {
		t.Fatalf("a role outside idem_app: %d %v %s", st, h, body)
	}
}

// TestStuckClaimsForOperators: the release flow from the public API, as the roles it names:
// the operator lists the lease claims in progress (principal, key, token, provider key),
// releases the dead one with its token, and the application role may do neither.
func TestStuckClaimsForOperators(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	app := newPool(t, pgtest.LoginRole(t, db, "idem_app"))
	ops := newPool(t, pgtest.LoginRole(t, db, "idem_operator"))
	d, err := idem.Begin(ctx, app, idem.Claim{Principal: "alice", Key: "pay-1", Action: "POST /pay", Lease: time.Minute,
		Fingerprint: idem.ComputeFingerprint("POST", "/pay", []byte(`{}`)).Sum})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("the lease claim: %+v %v", d, err)
	}
	stuck, err := idem.ReadStuck(ctx, ops, 0, 0)
	if err != nil || len(stuck) != 1 {
		t.Fatalf("ReadStuck: %+v %v", stuck, err)
	}
	s := stuck[0]
	if s.Principal != "alice" || s.Key != "pay-1" || s.Attempt != d.Attempt || s.ProviderKey != d.ProviderKey || s.LeaseRunOut ||
		s.ClaimedAt.IsZero() || !s.LeaseExpiresAt.After(s.ClaimedAt) {
		t.Fatalf("the stuck claim %+v, the claim %+v", s, d)
	}
	if list, err := idem.ReadStuck(ctx, ops, time.Hour, 0); err != nil || len(list) != 0 {
		t.Fatalf("claims older than an hour: %+v %v", list, err)
	}
	if _, err := idem.ReadStuck(ctx, app, 0, 0); !errors.Is(err, idem.ErrPermissionDenied) {
		t.Fatalf("ReadStuck as the application: %v, want ErrPermissionDenied", err)
	}
	if err := idem.ReleaseStuck(ctx, app, s.Principal, s.Key, s.Attempt, "x"); !errors.Is(err, idem.ErrPermissionDenied) {
		t.Fatalf("ReleaseStuck as the application: %v", err)
	}
	if err := idem.ReleaseStuck(ctx, ops, s.Principal, s.Key, s.Attempt, "process killed"); err != nil {
		t.Fatal(err)
	}
	// The release ends the lease and keeps the key with its request (its retry takes it over
	// with the same provider key) under a new token: the stuck holder, and a second release
	// with the old token, are fenced off.
	if k, ok, err := idem.ReadKey(ctx, ops, "alice", "pay-1"); err != nil || !ok || k.State != "in_progress" ||
		k.LeaseExpiresAt.After(time.Now()) || k.Attempt == s.Attempt {
		t.Fatalf("after the release: %+v %v %v", k, ok, err)
	}
	if err := idem.ReleaseStuck(ctx, ops, s.Principal, s.Key, s.Attempt, "again"); !errors.Is(err, idem.ErrClaimLost) {
		t.Fatalf("a second release with the old token: %v, want ErrClaimLost", err)
	}
}

// TestOptionsReportsTheDefaults: Middleware.Options reports every default it fills in, the
// attempts of a unit of work and the route template included (they read 0 and nil, though 3
// and DefaultRouteTemplate applied).
func TestOptionsReportsTheDefaults(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	m, err := idem.New(context.Background(), idem.Options{DB: pool, Principal: alice})
	if err != nil {
		t.Fatal(err)
	}
	o := m.Options()
	r := httptest.NewRequest("POST", "/v1/things/7", nil)
	if o.MaxAttempts != 3 || o.RouteTemplate == nil || o.RouteTemplate(r) != "/v1/things/7" ||
		o.KeyHeader != "Idempotency-Key" || o.CorrelationHeader != "X-Request-Id" || o.ProblemBase == "" {
		t.Fatalf("options in effect: MaxAttempts %d, RouteTemplate set %v, KeyHeader %q, CorrelationHeader %q, ProblemBase %q",
			o.MaxAttempts, o.RouteTemplate != nil, o.KeyHeader, o.CorrelationHeader, o.ProblemBase)
	}
}
