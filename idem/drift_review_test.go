package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestLeaseTransactionsSayReadCommitted: docs/DECISIONS.md D210: "Every transaction the
// library begins (the unit of work of RunTx, Do, the middleware and steps, a lease claim's own,
// the claim of a given-up lease) now says ISOLATION LEVEL READ COMMITTED unless the caller's
// TxOptions name a level"; docs/sql-api.md: "the Go driver's default: it begins its transactions
// ISOLATION LEVEL READ COMMITTED, whatever the role's or the database's
// default_transaction_isolation". Existing tests pin Do and the middleware's transactional unit;
// this pins the lease paths: a lease route's claim, its steps, the claim that takes over a
// lease given up after a 5xx, and DoLease's claim and steps, under a role whose default is
// SERIALIZABLE. A trigger on the key table records the isolation of every statement that
// writes a key's row.
func TestLeaseTransactionsSayReadCommitted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, `CREATE TABLE public.iso_log (iso text, q text, op text);
		GRANT INSERT, SELECT ON public.iso_log TO PUBLIC;
		CREATE FUNCTION public.iso_trig() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
		SET search_path = pg_catalog AS $$
		BEGIN
			INSERT INTO public.iso_log VALUES (current_setting('transaction_isolation'), current_query(), TG_OP);
			RETURN NULL;
		END $$;
		CREATE TRIGGER iso_log_trig AFTER INSERT OR UPDATE ON idem.idempotency_keys
			FOR EACH ROW EXECUTE FUNCTION public.iso_trig()`)
	pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, appURL)+` SET default_transaction_isolation = 'serializable'`)
	app := newPool(t, appURL)

	// A lease route with two steps; its first run fails after the first step (502: the lease
	// is given up), the retry takes the lease over and goes on after it.
	m := quietMiddleware(t, idem.Options{DB: app})
	var fail atomic.Bool
	fail.Store(true)
	h := m.Route(idem.Route{Action: "POST /pay", Required: true, Lease: 30 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idem.Step(r.Context(), "reserve", func(ctx context.Context, tx pgx.Tx) (int, error) { return 1, nil }); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if fail.Load() {
			http.Error(w, "provider down", http.StatusBadGateway)
			return
		}
		if _, err := idem.Step(r.Context(), "settle", func(ctx context.Context, tx pgx.Tx) (int, error) { return 2, nil }); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"ok":true}`))
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	if st, _, b := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", `{"amount":1}`, "Idempotency-Key", "iso-lease"); st != http.StatusBadGateway {
		t.Fatalf("first run: %d %s, want 502", st, b)
	}
	fail.Store(false)
	if st, _, b := pgtest.Send(t, ctx, "POST", srv.URL+"/pay", `{"amount":1}`, "Idempotency-Key", "iso-lease"); st != http.StatusCreated {
		t.Fatalf("retry: %d %s, want 201", st, b)
	}

	// DoLease with a step.
	job := idem.Job{Principal: "p", Key: "iso-dolease", Action: "a", Input: map[string]int{"n": 1}, Lease: 30 * time.Second}
	if _, _, err := idem.DoLease(ctx, app, job, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
		return idem.Step(ctx, "one", func(ctx context.Context, tx pgx.Tx) (int, error) { return 3, nil })
	}); err != nil {
		t.Fatalf("DoLease: %v", err)
	}

	rows, err := admin.Query(ctx, `SELECT iso, q, op FROM public.iso_log`)
	if err != nil {
		t.Fatal(err)
	}
	type entry struct{ iso, q, op string }
	var all []entry
	for rows.Next() {
		var e entry
		if err := rows.Scan(&e.iso, &e.q, &e.op); err != nil {
			t.Fatal(err)
		}
		all = append(all, e)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	claims, steps := 0, 0
	for _, e := range all {
		isClaim := strings.Contains(e.q, "idem_begin")
		isStep := strings.Contains(e.q, "idem_step")
		if isClaim {
			claims++
		}
		if isStep {
			steps++
		}
		if (isClaim || isStep) && e.iso != "read committed" {
			t.Errorf("%s of the key's row at %q (the role's default is serializable); documented READ COMMITTED: %s", e.op, e.iso, e.q)
		}
	}
	isos := map[string]int{}
	for _, e := range all {
		isos[e.iso]++
	}
	t.Logf("isolations of the writes of the key's row: %v", isos)
	if claims < 3 || steps < 3 {
		t.Fatalf("recorded %d claims and %d steps, want at least 3 of each: %+v", claims, steps, all)
	}
}

// TestChangedFieldsOtherActionWhateverBody: docs/http.md (idempotency_key_reuse):
// "changed_fields ... is [] whenever the action changed (another method or route: the body is
// then not compared, whatever it holds), and absent when that is unknown (a body that is not a
// JSON object, ...)". Pinned elsewhere only with the same JSON object body on both actions;
// here the bodies differ, and one of them is not a JSON object.
func TestChangedFieldsOtherActionWhateverBody(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	mux := http.NewServeMux()
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"ok":true}`))
	})
	mux.Handle("POST /a", m.Route(idem.Route{Action: "POST /a", Required: true})(ok))
	mux.Handle("PUT /a", m.Route(idem.Route{Action: "PUT /a", Required: true})(ok))
	mux.Handle("POST /b", m.Route(idem.Route{Action: "POST /b", Required: true})(ok))
	mux.Handle("POST /lb", m.Route(idem.Route{Action: "POST /lb", Required: true, Lease: 10 * time.Second})(ok))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	ct := []string{"Content-Type", "application/json"}
	many := map[string]int{}
	for i := range 70 {
		many["f"+strings.Repeat("x", i%3)+string(rune('a'+i%26))+string(rune('a'+i/26))] = i
	}
	manyJSON, _ := json.Marshal(many)
	for i, c := range []struct {
		name              string
		firstPath, first  string
		method, path, req string
	}{
		{"object, then another route with other members", "/a", `{"amount":1}`, "POST", "/b", `{"currency":"EUR"}`},
		{"array, then another route with an object", "/a", `[1,2,3]`, "POST", "/b", `{"amount":1}`},
		{"object, then another route with an array", "/a", `{"amount":1}`, "POST", "/b", `[1]`},
		{"object, then another method with another object", "/a", `{"amount":1}`, "PUT", "/a", `{"amount":2,"x":1}`},
		{"71 members, then another route", "/a", string(manyJSON), "POST", "/b", `{"amount":1}`},
		{"object, then a lease route with another object", "/a", `{"amount":1}`, "POST", "/lb", `{"amount":2}`},
		{"string on a lease route, then a transactional route", "/lb", `"s"`, "POST", "/a", `{"amount":2}`},
	} {
		key := "cf-" + string(rune('a'+i))
		if st, _, b := pgtest.Send(t, ctx, "POST", srv.URL+c.firstPath, c.first, append([]string{"Idempotency-Key", key}, ct...)...); st != 201 {
			t.Fatalf("%s: first %d %s", c.name, st, b)
		}
		st, _, b := pgtest.Send(t, ctx, c.method, srv.URL+c.path, c.req, append([]string{"Idempotency-Key", key}, ct...)...)
		var p struct {
			Code          string    `json:"code"`
			ChangedFields *[]string `json:"changed_fields"`
		}
		_ = json.Unmarshal([]byte(b), &p)
		if st != 422 || p.ChangedFields == nil || len(*p.ChangedFields) != 0 {
			t.Errorf("%s: %d %s; want 422 with \"changed_fields\":[] (the action changed)", c.name, st, b)
		}
	}
}

// TestServesRaiseReasonSaysSo: docs/DECISIONS.md D204: "a function that
// raises an error of its own serves nothing (the reason says so)". A newer release's
// idem_serves_version that raises: CheckSchema refuses (ErrSchemaNewer, pinned elsewhere), and
// its error, the reason New, StartCleaner, Do and a /healthz give, must say that the function
// failed (and how), not only that the schema is newer: it said "newer than this code's" and
// "upgrade", nothing of the failure.
func TestServesRaiseReasonSaysSo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, `RAISE EXCEPTION 'serves-broken';`)
	err := idem.CheckSchema(ctx, app)
	if !errors.Is(err, idem.ErrSchemaNewer) {
		t.Fatalf("CheckSchema: %v; want ErrSchemaNewer", err)
	}
	var se *idem.SchemaError
	if !errors.As(err, &se) || !strings.Contains(se.Raised, "serves-broken") {
		t.Errorf("CheckSchema's SchemaError does not carry what the function raised: %#v", se)
	}
	if msg := err.Error(); !strings.Contains(msg, "idem_serves_version") || !strings.Contains(msg, "serves-broken") {
		t.Errorf("CheckSchema's reason when the newer release's idem_serves_version raised: %q; "+
			"it does not say that the function failed (D204: \"the reason says so\")", msg)
	}
}

// TestServesTimeoutIsNotNewer: D204: "a connection lost, a cancel, a
// timeout or a serialization failure during the call is the database's error as any other
// statement's (IsUnavailable tells), not a newer release that refuses this one". A
// statement_timeout of the role that ends the idem_serves_version call: not ErrSchemaNewer.
func TestServesTimeoutIsNotNewer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	owner, url := pgtest.NewPool(t, 4)
	appURL := pgtest.LoginRole(t, url, "idem_app")
	pgtest.Exec(t, owner, `ALTER ROLE `+roleOf(t, appURL)+` SET statement_timeout = '300ms'`)
	app := newPool(t, appURL)
	want := idem.SchemaVersion()
	servesNext(t, owner, want+1, want+1, `PERFORM pg_sleep(2); RETURN true;`)
	err := idem.CheckSchema(ctx, app)
	var se *idem.SchemaError
	if err == nil || errors.As(err, &se) || errors.Is(err, idem.ErrSchemaNewer) {
		t.Errorf("CheckSchema whose idem_serves_version call met the role's statement_timeout: %v; want the database's error, not a newer release that refuses", err)
	}
}

// TestEmptyBodyWhateverContentType: docs/http.md: "A request without a
// body has none to declare: an empty body is the same request whatever its Content-Type says
// (the fingerprint is the method and the path)". The reference server pins text/plain against
// application/json on a transactional route; here the library's transactional and lease routes,
// with no Content-Type, JSON, JSON with a charset, text/plain, a form, multipart and a chunked
// empty body: every attempt after the first is a replay of the first's answer.
func TestEmptyBodyWhateverContentType(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := pgtest.NewPool(t, 4)
	m := quietMiddleware(t, idem.Options{DB: pool})
	var runs atomic.Int32
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"ok":true}`))
	})
	mux := http.NewServeMux()
	mux.Handle("POST /tx", m.Route(idem.Route{Action: "POST /tx", Required: true})(ok))
	mux.Handle("POST /lease", m.Route(idem.Route{Action: "POST /lease", Required: true, Lease: 10 * time.Second})(ok))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	types := []string{"", "application/json", "application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded",
		"multipart/form-data; boundary=b1", "application/octet-stream"}
	for _, path := range []string{"/tx", "/lease"} {
		before := runs.Load()
		key := "empty" + path[1:]
		for i, ct := range types {
			st, h, b := pgtest.Send(t, ctx, "POST", srv.URL+path, "", "Idempotency-Key", key, "Content-Type", ct)
			if st != http.StatusCreated {
				t.Errorf("%s, empty body as %q: %d %s, want 201", path, ct, st, b)
			}
			if i > 0 && h.Get("Idempotent-Replayed") != "true" {
				t.Errorf("%s, empty body as %q after %q: not a replay (%d %s)", path, ct, types[0], st, b)
			}
		}
		// A chunked request whose body is empty.
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+path, strings.NewReader(""))
		req.TransferEncoding = []string{"chunked"}
		req.Body = io.NopCloser(strings.NewReader(""))
		req.ContentLength = -1
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "text/plain")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusCreated || res.Header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("%s, a chunked empty body as text/plain: %d replayed=%q %s; want the first's 201 replayed", path, res.StatusCode, res.Header.Get("Idempotent-Replayed"), body)
		}
		if n := runs.Load() - before; n != 1 {
			t.Errorf("%s: the handler ran %d times for one request without a body, want 1", path, n)
		}
	}
}

// TestLeaseAnswerRecordingRetried40001: docs/DECISIONS.md D210: "The library's single
// statements outside a transaction (an extension, a yield, an answer's recording) run at the
// role's default and are tried again on 40001 (Persist)". Under a role whose
// default_transaction_isolation is repeatable read (or serializable), a lease route's 201 whose
// recording waits on the key's row, which another session updates and commits meanwhile, meets
// 40001 on its first try; it must be tried again: the client gets its 201, and a repeat replays
// it. Likewise a 502's yield.
func TestLeaseAnswerRecordingRetried40001(t *testing.T) {
	t.Parallel()
	for _, iso := range []string{"repeatable read", "serializable"} {
		for _, answer := range []int{http.StatusCreated, http.StatusBadGateway} {
			t.Run(strings.ReplaceAll(iso, " ", "_")+"/"+http.StatusText(answer), func(t *testing.T) {
				t.Parallel()
				driftRecording40001(t, iso, answer)
			})
		}
	}
}

func driftRecording40001(t *testing.T, iso string, answer int) {
	ctx := context.Background()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	admin := pgtest.Connect(t, db)
	pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, appURL)+` SET default_transaction_isolation = '`+iso+`'`)
	app := newPool(t, appURL)
	m := quietMiddleware(t, idem.Options{DB: app})
	inHandler := make(chan struct{})
	proceed := make(chan struct{})
	var runs atomic.Int32
	srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /pay", Required: true, Lease: 30 * time.Second})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			if runs.Add(1) == 1 {
				close(inHandler)
				<-proceed
			}
			w.WriteHeader(answer)
			_, _ = w.Write([]byte(`{"paid":true}`))
		})))
	defer srv.Close()
	type reply struct {
		st   int
		body string
	}
	first := make(chan reply, 1)
	go func() {
		st, _, b := pgtest.Send(t, ctx, "POST", srv.URL, `{"amount":1}`, "Idempotency-Key", "k40001")
		first <- reply{st, b}
	}()
	<-inHandler
	// Another session changes the key's row (a no-op update: a new row version) and holds it.
	other := pgtest.Connect(t, db)
	pgtest.Exec(t, other, `BEGIN`)
	pgtest.Exec(t, other, `UPDATE idem.idempotency_keys SET lease_expires_at = lease_expires_at WHERE key = 'k40001'`)
	close(proceed)
	pgtest.WaitFor(t, admin, `SELECT count(*) FROM pg_stat_activity AS a JOIN pg_locks AS l ON l.pid = a.pid AND NOT l.granted
		WHERE a.datname = current_database() AND (a.query LIKE '%idem_complete%' OR a.query LIKE '%idem_yield%')`)
	pgtest.Exec(t, other, `COMMIT`)
	r := <-first
	if r.st != answer {
		t.Errorf("%s, the %d's recording met a concurrent update of the key's row: the client got %d %s; want its %d (40001 tried again)",
			iso, answer, r.st, r.body, answer)
	}
	var state string
	var status *int
	if err := admin.QueryRow(ctx, `SELECT state::text, response_status FROM idem.idempotency_keys WHERE key = 'k40001'`).Scan(&state, &status); err != nil {
		t.Fatal(err)
	}
	if answer == http.StatusCreated && (state != "c" || status == nil || *status != answer) {
		t.Errorf("%s: the key after the 201: state %s status %v; want completed with 201", iso, state, status)
	}
	if answer == http.StatusBadGateway {
		// The yield landed: a retry takes the lease over at once.
		st, _, b := pgtest.Send(t, ctx, "POST", srv.URL, `{"amount":1}`, "Idempotency-Key", "k40001")
		if st != answer || runs.Load() != 2 {
			t.Errorf("%s: the retry after the 502 whose yield met 40001: %d %s after %d runs; want the handler run again at once",
				iso, st, b, runs.Load())
		}
	}
}
