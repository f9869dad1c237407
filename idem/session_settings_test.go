package idem_test

// The login role's settings through the Go library (D231). A service's login role may carry
// settings from ALTER ROLE ... SET (a legacy application's DateStyle, bytea_output), and the
// library supports pgx's QueryExecModeExec, which reads every result as text, written in those
// settings. An adversarial review (helper session) found, in that mode: every replay failed
// with bytea_output = 'escape' ("invalid hex format": pgx reads hex only), every lease was lost
// at its first heartbeat and ReadKey failed with DateStyle 'SQL, DMY' (pgx parses ISO
// timestamps only); and in every mode, with standard_conforming_strings off, every Do failed
// with ErrInvalidArgument (the functions' '\x00' literals, tests/session_settings_test.go).

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// legacyRoleSettings are settings of a legacy application's login role, each of which changes
// what a text result looks like, or how the functions' literals read.
var legacyRoleSettings = []string{
	"DateStyle = 'SQL, DMY'", "bytea_output = 'escape'", "IntervalStyle = 'sql_standard'",
	"extra_float_digits = -15", "TimeZone = 'Asia/Kathmandu'", "standard_conforming_strings = off",
}

// settingsPool is a pool, in mode, of a new login role in idem_app given sets by ALTER ROLE.
func settingsPool(t *testing.T, mode pgx.QueryExecMode, sets ...string) *pgxpool.Pool {
	t.Helper()
	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	admin := pgtest.Connect(t, db)
	for _, s := range sets {
		pgtest.Exec(t, admin, `ALTER ROLE `+roleOf(t, appURL)+` SET `+s)
	}
	return modePool(t, appURL, mode)
}

// modePool is a pool of url in mode, closed when the test ends.
func modePool(t *testing.T, url string, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.DefaultQueryExecMode = mode
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestLegacyRoleSettingsChangeNoAnswer: under legacyRoleSettings, in the default mode and in
// QueryExecModeExec, a Do's repeat replays, the middleware replays a body of every byte value,
// a DoLease keeps its lease through its heartbeats, and the operators' reads give the times and
// durations the database holds.
func TestLegacyRoleSettingsChangeNoAnswer(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := settingsPool(t, mode, legacyRoleSettings...)
			var style string
			if err := pool.QueryRow(ctx, `SHOW DateStyle`).Scan(&style); err != nil || style != "SQL, DMY" {
				t.Fatalf("the role's DateStyle: %q %v", style, err)
			}

			type result struct {
				ID   int    `json:"id"`
				Note string `json:"note"`
			}
			job := idem.Job{Principal: "p", Key: "do-1", Action: "a", Input: map[string]int{"a": 1}}
			runs := 0
			fn := func(context.Context, pgx.Tx) (result, error) { runs++; return result{7, "n\u00e9"}, nil }
			r1, rep1, err := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			if err != nil || rep1 {
				t.Fatalf("first Do: %v %v %v", r1, rep1, err)
			}
			r2, rep2, err := idem.Do(ctx, pool, job, idem.TxOptions{}, fn)
			if err != nil || !rep2 || r2 != r1 || runs != 1 {
				t.Errorf("the repeat of a committed Do: %v replayed %v, %v (fn ran %d times); want %v replayed", r2, rep2, err, runs, r1)
			}

			every := make([]byte, 256)
			for i := range every {
				every[i] = byte(i)
			}
			m := quietMiddleware(t, idem.Options{DB: pool})
			handled := 0
			h := m.Route(idem.Route{Action: "POST /blobs", Required: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				handled++
				w.Header().Set("Content-Type", "application/octet-stream")
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write(every)
			}))
			srv := httptest.NewServer(h)
			defer srv.Close()
			for i := 0; i < 2; i++ {
				st, _, body := pgtest.Send(t, ctx, "POST", srv.URL+"/blobs", `{"n":1}`, "Idempotency-Key", "k-every-byte")
				if st != http.StatusCreated || !bytes.Equal([]byte(body), every) || handled != 1 {
					t.Errorf("request %d: %d, %d bytes (handler ran %d times); want 201 with the 256 byte values, the repeat replayed", i+1, st, len(body), handled)
				}
			}

			lease := idem.Job{Principal: "p", Key: "lease-1", Action: "a", Lease: 1500 * time.Millisecond}
			v, replayed, err := idem.DoLease(ctx, pool, lease, func(ctx context.Context, c idem.LeaseClaim) (int, error) {
				select {
				case <-ctx.Done():
					return 0, context.Cause(ctx)
				case <-time.After(2500 * time.Millisecond): // past the lease: the heartbeats keep it
				}
				return 8, nil
			})
			if err != nil || replayed || v != 8 {
				t.Errorf("DoLease whose work (2.5 s) outlives its lease (1.5 s): %v replayed %v, %v; want 8", v, replayed, err)
			}

			story, ok, err := idem.ReadKey(ctx, pool, "p", "do-1")
			if err != nil || !ok {
				t.Fatalf("ReadKey of a completed key: %+v %v %v", story, ok, err)
			}
			if until := time.Until(story.KeptUntil); until < 23*time.Hour || until > 25*time.Hour {
				t.Errorf("ReadKey: kept until %v (%v from now), want the default TTL of 24 hours", story.KeptUntil, until)
			}
			d, err := idem.ReadDefaults(ctx, pool)
			if err != nil || d.TTL != 24*time.Hour || d.LockTimeout != 2*time.Second {
				t.Errorf("ReadDefaults: %+v %v; want 24 hours and 2 seconds", d, err)
			}
		})
	}
}

// TestStartRefusesAClientEncodingOtherThanUTF8: pgx sends Go's strings as UTF-8 whatever the
// session's client_encoding says. A review (helper session) found a login role set to LATIN1
// storing the principal "müller" as "mÃ¼ller", and a repeat on a connection opened after the
// role's change running the work again (D232). The start check (New, the first Do on a pool)
// refuses such a pool, naming the setting, and nothing is stored; the same role with
// client_encoding=UTF8 in its connection string works.
func TestStartRefusesAClientEncodingOtherThanUTF8(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := settingsPool(t, pgx.QueryExecModeCacheStatement, "client_encoding = 'LATIN1'")
	job := idem.Job{Principal: "müller", Key: "k", Action: "a"}
	ran := false
	_, _, err := idem.Do(ctx, pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { ran = true; return 1, nil })
	if err == nil || ran || !strings.Contains(err.Error(), "client_encoding is LATIN1") {
		t.Errorf("Do on a pool whose client_encoding is LATIN1: %v (ran %v); want the start check's refusal naming it", err, ran)
	}
	if _, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "p", true }}); err == nil || !strings.Contains(err.Error(), "client_encoding=UTF8") {
		t.Errorf("New on that pool: %v; want the refusal with its remedy", err)
	}
	if _, ok, err := idem.ReadKey(ctx, pool, job.Principal, job.Key); ok || err != nil {
		t.Errorf("the key after the refusal: %v %v; want none", ok, err)
	}

	cfg := pool.Config()
	cfg.ConnConfig.RuntimeParams["client_encoding"] = "UTF8"
	utf8Pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer utf8Pool.Close()
	for i := 0; i < 2; i++ {
		v, replayed, err := idem.Do(ctx, utf8Pool, job, idem.TxOptions{}, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
		if err != nil || v != 1 || replayed != (i == 1) {
			t.Fatalf("Do %d with client_encoding=UTF8: %v %v %v", i+1, v, replayed, err)
		}
	}
	if _, ok, err := idem.ReadKey(ctx, utf8Pool, "müller", "k"); !ok || err != nil {
		t.Errorf("ReadKey(müller) through a UTF8 connection: %v %v; want the key", ok, err)
	}
}
