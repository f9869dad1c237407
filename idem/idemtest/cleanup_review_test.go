package idemtest_test

// idemtest, the test helpers for users, from a review of them: clean-up, t.Parallel, the
// connection strings it hands out.

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemtest"
)

// helperChild selects what this test binary does when run as a child by TestServerStopsWhenTheTestsEnd:
// "nomain" runs the tests without idemtest.Main (a user's package that has no TestMain, or one
// that calls m.Run itself); "panic" runs them with idemtest.Main and a test that panics (what
// `go test -timeout` does when a test hangs, and what any nil dereference in a test does).
const helperChildEnv = "IDEMTEST_HELPER_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(helperChildEnv) == "nomain" {
		os.Exit(m.Run())
	}
	os.Exit(idemtest.Main(m))
}

// TestHelperProcessChild is the child's test: it makes a database and prints where its server is.
func TestHelperProcessChild(t *testing.T) {
	mode := os.Getenv(helperChildEnv)
	if mode == "" {
		return // the helper process of TestServerStopsWhenTheTestsEnd: nothing to do in a normal run
	}
	url := idemtest.NewDB(t)
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	var dir string
	if err := conn.QueryRow(context.Background(), `SELECT current_setting('data_directory')`).Scan(&dir); err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())
	fmt.Printf("HELPERURL %s\nHELPERDIR %s\n", url, dir)
	if mode == "panic" {
		panic("a test that panics (or that go test -timeout ends)")
	}
}

// helperStopLeaked stops a server this test's child left running (by the postmaster's pid, read
// from its data directory) and removes its directory.
func helperStopLeaked(t *testing.T, dir string) {
	b, err := os.ReadFile(filepath.Join(dir, "postmaster.pid"))
	if err != nil {
		return
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 1 {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGQUIT) // immediate shutdown
	for i := 0; i < 100; i++ {
		if syscall.Kill(pid, 0) != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The cluster's temporary directory is two levels above the data directory
	// (idem-pgtest-*/pg/data).
	if top := filepath.Dir(filepath.Dir(dir)); strings.Contains(filepath.Base(top), "idem-pgtest-") {
		_ = os.RemoveAll(top)
	}
}

// TestServerStopsWhenTheTestsEnd: the package says the private cluster is "removed when the
// tests end". A test binary that did not call idemtest.Main (NewDB's doc did not ask for it),
// or one in which a test panicked (a nil dereference; go test -timeout), left the private
// PostgreSQL server running and its temporary directory behind, on every run: pg_ctl starts
// the server in a session of its own. A watchdog process now stops it once the test binary is
// gone. Asserted: within a few seconds of the child binary's exit, its server no longer
// accepts connections and its directory is gone.
func TestServerStopsWhenTheTestsEnd(t *testing.T) {
	for _, mode := range []string{"nomain", "panic"} {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcessChild$", "-test.count=1")
			// The child uses a private cluster whatever this run uses.
			cmd.Env = append(os.Environ(), helperChildEnv+"="+mode, "PGTEST_NO_DOCKER=1", "TEST_DATABASE_URL=")
			out, _ := cmd.CombinedOutput()
			var url, dir string
			sc := bufio.NewScanner(strings.NewReader(string(out)))
			for sc.Scan() {
				if v, ok := strings.CutPrefix(sc.Text(), "HELPERURL "); ok {
					url = v
				}
				if v, ok := strings.CutPrefix(sc.Text(), "HELPERDIR "); ok {
					dir = v
				}
			}
			if url == "" {
				t.Fatalf("child printed no URL:\n%s", out)
			}
			defer helperStopLeaked(t, dir)
			// The test's database was dropped by its cleanup; the server's own database tells
			// whether the server still runs. The watchdog looks every second.
			for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(200 * time.Millisecond) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				conn, err := pgx.Connect(ctx, url+" dbname=postgres")
				cancel()
				_, statErr := os.Stat(dir)
				if err != nil && os.IsNotExist(statErr) {
					break
				}
				if conn != nil {
					conn.Close(context.Background())
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: 15 s after the child test binary exited its PostgreSQL server (%s) still runs, or its directory is left", mode, dir)
				}
			}
		})
	}
}

// TestParallelAndCleanup: NewPool and AppPool under t.Parallel, each subtest with its
// own database and role, a middleware as the app role and a keyed request; after the subtests
// end their databases and roles are gone. Asserted: every subtest is served 201; no database
// or role of theirs is left.
func TestParallelAndCleanup(t *testing.T) {
	var names [6]string
	var roles [6]string
	admin := idemtest.NewPool(t)
	t.Run("group", func(t *testing.T) {
		for i := range 6 {
			t.Run(fmt.Sprint(i), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				owner := idemtest.NewPool(t)
				app := idemtest.AppPool(t, owner)
				names[i] = owner.Config().ConnConfig.Database
				if err := app.QueryRow(ctx, `SELECT current_user`).Scan(&roles[i]); err != nil {
					t.Fatal(err)
				}
				m, err := idem.New(ctx, idem.Options{DB: app, Principal: func(*http.Request) (string, bool) { return "alice", true }})
				if err != nil {
					t.Fatal(err)
				}
				srv := httptest.NewServer(m.Route(idem.Route{Action: "POST /x"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.WriteHeader(201)
				})))
				defer srv.Close()
				req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
				req.Header.Set("Idempotency-Key", "k")
				res, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				res.Body.Close()
				if res.StatusCode != 201 {
					t.Fatalf("status %d", res.StatusCode)
				}
			})
		}
	})
	ctx := context.Background()
	for i := range 6 {
		var n int
		if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM pg_database WHERE datname = $1) + (SELECT count(*) FROM pg_roles WHERE rolname = $2)`,
			names[i], roles[i]).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("subtest %d: its database %q or role %q is left", i, names[i], roles[i])
		}
	}
}

// TestAppURLKeepsTheConnectionSettings: AppURL "returns the connection string of the database
// url names as a new login role". It rebuilt the string from the host, port and database alone,
// with sslmode=disable: a connect timeout (which Options.DB's doc asks for), the application
// name and TLS (a TEST_DATABASE_URL may need it) were dropped. Only the user and the password
// change now.
func TestAppURLKeepsTheConnectionSettings(t *testing.T) {
	owner := idemtest.NewPool(t)
	base, err := pgx.ParseConfig(owner.Config().ConnConfig.ConnString())
	if err != nil {
		t.Fatal(err)
	}
	in := fmt.Sprintf("host=%s port=%d dbname=%s user=%s password=%s connect_timeout=7 application_name=helperapp sslmode=prefer",
		base.Host, base.Port, base.Database, base.User, base.Password)
	if base.Password == "" {
		in = strings.Replace(in, " password=", "", 1)
	}
	out := idemtest.AppURL(t, in)
	cfg, err := pgx.ParseConfig(out)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ConnectTimeout != 7*time.Second || cfg.RuntimeParams["application_name"] != "helperapp" || !strings.Contains(out, "sslmode=prefer") {
		t.Errorf("AppURL(%q) = %q: connect_timeout %s, application_name %q, sslmode kept %v; want url's settings kept",
			in, out, cfg.ConnectTimeout, cfg.RuntimeParams["application_name"], strings.Contains(out, "sslmode=prefer"))
	}
	// And the pool it makes works.
	p, err := pgxpool.New(context.Background(), out)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
}
