package pgtest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
)

// The Citus tests (make test-citus, files built with the citus tag) run against a real Citus
// cluster named by CITUS_URL: a postgres:// URL of its coordinator, as a superuser, in a
// database where the citus extension is created and the workers are added
// (scripts/citus-dev-cluster.sh builds such a cluster on a development machine; CI has none).
// Each test gets a database of its own on every node, set up as docs/scale-out.md says.

const citusHowTo = `pgtest: the Citus tests need CITUS_URL: a postgres:// URL of a Citus coordinator, as a superuser,
in a database where the citus extension is created and the workers are added. On a development machine:
  scripts/citus-dev-cluster.sh build && scripts/citus-dev-cluster.sh start
  CITUS_URL=$(scripts/citus-dev-cluster.sh url) make test-citus
(docs/scale-out.md, "A Citus cluster on a development machine"; CI has no Citus)`

// CitusNode is a node of the Citus cluster as the coordinator knows it.
type CitusNode struct {
	Host string
	Port int
}

// CitusURL returns CITUS_URL after checking that it names a Citus coordinator with at least one
// active worker; it fails the test otherwise (it never skips).
func CitusURL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("CITUS_URL")
	if u == "" {
		t.Fatal(citusHowTo)
	}
	if p, err := url.Parse(u); err != nil || (p.Scheme != "postgres" && p.Scheme != "postgresql") || len(p.Path) < 2 {
		t.Fatalf("pgtest: CITUS_URL is not a postgres:// URL with a database: %q\n%s", u, citusHowTo)
	}
	conn := Connect(t, u)
	var group *int
	var workers int
	if err := conn.QueryRow(context.Background(), `SELECT (SELECT groupid FROM pg_dist_local_group),
		(SELECT count(*) FROM pg_dist_node WHERE groupid <> 0 AND isactive AND noderole = 'primary')`).Scan(&group, &workers); err != nil {
		t.Fatalf("pgtest: CITUS_URL does not name a Citus node (%v)\n%s", err, citusHowTo)
	}
	if group == nil || *group != 0 || workers == 0 {
		t.Fatalf("pgtest: CITUS_URL names a Citus node that is not a coordinator with workers (group %v, %d workers)\n%s", group, workers, citusHowTo)
	}
	return u
}

// CitusNodes returns the coordinator (as it names itself, or CITUS_URL's host and port) and
// the active primary workers of the cluster at CITUS_URL.
func CitusNodes(t testing.TB) (coordinator CitusNode, workers []CitusNode) {
	t.Helper()
	u := CitusURL(t)
	conn := Connect(t, u)
	rows, err := conn.Query(context.Background(), `SELECT nodename, nodeport, groupid FROM pg_dist_node
		WHERE isactive AND noderole = 'primary' ORDER BY groupid`)
	if err != nil {
		t.Fatal(err)
	}
	parsed, _ := url.Parse(u)
	port, _ := strconv.Atoi(parsed.Port())
	if port == 0 {
		port = 5432
	}
	coordinator = CitusNode{parsed.Hostname(), port}
	for rows.Next() {
		var n CitusNode
		var group int
		if err := rows.Scan(&n.Host, &n.Port, &group); err != nil {
			t.Fatal(err)
		}
		if group == 0 {
			coordinator = n
		} else {
			workers = append(workers, n)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return coordinator, workers
}

// citusNodeURL is CITUS_URL with another node and database.
func citusNodeURL(base string, n CitusNode, db string) string {
	u, _ := url.Parse(base)
	u.Host = net.JoinHostPort(n.Host, strconv.Itoa(n.Port))
	u.Path = "/" + db
	return u.String()
}

// CitusDB creates a database of its own for the test on every node of the cluster at
// CITUS_URL, with the citus extension in it, the coordinator named and the workers added
// (docs/scale-out.md, steps 2 and 3), and returns its URL at the coordinator. Install the API
// (CitusInstall) and distribute it (CitusDistribute) next. The database is dropped from
// every node when the test ends (CITUS_KEEP=1 keeps it, to look at).
func CitusDB(t testing.TB) string {
	t.Helper()
	base := CitusURL(t)
	coordinator, workers := CitusNodes(t)
	baseDB, _ := url.Parse(base)
	name := fmt.Sprintf("idem_citus_%d_%d", os.Getpid(), counter.Add(1))
	ctx := context.Background()
	nodes := append([]CitusNode{coordinator}, workers...)
	for _, n := range nodes {
		Exec(t, Connect(t, citusNodeURL(base, n, baseDB.Path[1:])), `CREATE DATABASE `+name)
	}
	if os.Getenv("CITUS_KEEP") == "" {
		t.Cleanup(func() {
			for _, n := range nodes { // the coordinator first: it holds connections to the workers
				conn, err := pgx.Connect(ctx, citusNodeURL(base, n, baseDB.Path[1:]))
				if err != nil {
					t.Logf("pgtest: dropping %s on %s:%d: %v", name, n.Host, n.Port, err)
					continue
				}
				if _, err := conn.Exec(ctx, `DROP DATABASE `+name+` WITH (FORCE)`); err != nil {
					t.Logf("pgtest: dropping %s on %s:%d: %v", name, n.Host, n.Port, err)
				}
				_ = conn.Close(ctx)
			}
		})
	} else {
		t.Logf("pgtest: CITUS_KEEP: the database %s stays on every node", name)
	}
	for _, n := range nodes {
		Exec(t, Connect(t, citusNodeURL(base, n, name)), `CREATE EXTENSION citus`)
	}
	db := citusNodeURL(base, coordinator, name)
	conn := Connect(t, db)
	Exec(t, conn, `SELECT citus_set_coordinator_host($1, $2)`, coordinator.Host, coordinator.Port)
	for _, w := range workers {
		Exec(t, conn, `SELECT citus_add_node($1, $2)`, w.Host, w.Port)
	}
	return db
}

// CitusNodeURL is db (a database of CitusDB) at another node of the cluster.
func CitusNodeURL(t testing.TB, db string, n CitusNode) string {
	t.Helper()
	u, err := url.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	return citusNodeURL(db, n, u.Path[1:])
}

// Psql runs psql -v ON_ERROR_STOP=1 with args against url, from the repository's root (so
// that args name files as the docs do: -f sql/idem.sql), and returns its output; it fails the
// test when psql does.
func Psql(t testing.TB, url string, args ...string) string {
	t.Helper()
	cmd := exec.Command("psql", append([]string{"-X", "-v", "ON_ERROR_STOP=1", "-d", url}, args...)...)
	cmd.Dir = repoRoot(t)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("psql %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// repoRoot is the repository's root: the directory of go.mod above this file.
func repoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("pgtest: no caller information")
	}
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// CitusInstall installs the SQL API into db at the coordinator as docs/scale-out.md says
// (step 4): psql -f sql/idem.sql, after the workers were added.
func CitusInstall(t testing.TB, db string) {
	t.Helper()
	Psql(t, db, "-q", "-f", "sql/idem.sql")
}

// CitusDistribute runs sql/citus/distribute.sql against db at the coordinator (step 5) and
// returns its output.
func CitusDistribute(t testing.TB, db string) string {
	t.Helper()
	return Psql(t, db, "-f", "sql/citus/distribute.sql")
}
