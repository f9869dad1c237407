package tests

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// replaceBlock returns doc with the text between the begin marker (a line starting with
// begin) and the end marker replaced by block, and the text that was there.
func replaceBlock(t *testing.T, doc, begin, end, block string) (string, string) {
	t.Helper()
	i := strings.Index(doc, begin)
	if i < 0 {
		t.Fatalf("no %q marker", begin)
	}
	i += strings.Index(doc[i:], "\n") + 1
	j := strings.Index(doc[i:], end)
	if j < 0 {
		t.Fatalf("no %q marker", end)
	}
	return doc[:i] + block + doc[i+j:], doc[i : i+j]
}

// checkDocBlock compares a generated block with the doc's copy, or rewrites the doc when
// UPDATE_DOCS is set.
func checkDocBlock(t *testing.T, path, begin, end, block string) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	updated, have := replaceBlock(t, string(raw), begin, end, block)
	if os.Getenv("UPDATE_DOCS") != "" {
		if err := os.WriteFile(path, []byte(updated), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if have != block {
		t.Fatalf("%s is out of date; run UPDATE_DOCS=1 make test and review the diff.\n--- generated:\n%s--- in the doc:\n%s", path, block, have)
	}
}

// psqlCommand is psql (next to the local initdb) with args, connected to url through the PG*
// variables, in UTC and a UTF-8 locale, reading no psqlrc.
func psqlCommand(t *testing.T, url string, args ...string) *exec.Cmd {
	t.Helper()
	bin, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(bin, "psql")
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("psql not found next to initdb in %s: apt-get install postgresql-client-15 (%v)", bin, err)
	}
	cmd := exec.Command(path, append([]string{"-X"}, args...)...)
	cmd.Env = append(os.Environ(), "PGHOST="+cfg.Host, "PGPORT="+strconv.Itoa(int(cfg.Port)), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password, "PGDATABASE="+cfg.Database, "PGOPTIONS=-c timezone=UTC", "LC_ALL=C.UTF-8")
	return cmd
}

// psql runs psql quietly with the script on standard input against url and returns what it
// printed.
func psql(t *testing.T, url string, script []byte, args ...string) string {
	t.Helper()
	cmd := psqlCommand(t, url, append([]string{"-q"}, args...)...)
	cmd.Stdin = bytes.NewReader(script)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("psql: %v\n%s", err, out)
	}
	return string(out)
}

// psqlRoles creates the login roles the docs' psql sessions switch to (\c - ROLE): shop_app in
// idem_app and ops_alice in idem_operator, with the test server's password when it has one
// (psql reconnects with PGPASSWORD), unless they exist; they are dropped when the test ends.
func psqlRoles(t *testing.T, url string) {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	password := ""
	if cfg.Password != "" {
		password = " PASSWORD '" + strings.ReplaceAll(cfg.Password, "'", "''") + "'"
	}
	admin := pgtest.Connect(t, url)
	for role, group := range map[string]string{"shop_app": "idem_app", "ops_alice": "idem_operator"} {
		pgtest.Exec(t, admin, `DO $$ BEGIN
			IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '`+role+`') THEN
				CREATE ROLE `+role+` LOGIN`+password+` IN ROLE `+group+`;
			END IF; END $$`)
	}
}

// TestPsqlSessionMatchesDocs runs the psql session of docs/sql-api.md on a fresh database
// with the SQL API installed alone, as the roles it names (the application's shop_app and the
// operator's ops_alice, which it switches to with \c), and compares what psql prints with the
// doc.
func TestPsqlSessionMatchesDocs(t *testing.T) {
	t.Parallel()
	url := pgtest.NewEmptyDB(t)
	conn := pgtest.Connect(t, url)
	if err := idemsql.Migrate(context.Background(), conn, idemsql.Options{}); err != nil {
		t.Fatal(err)
	}
	psqlRoles(t, url)
	script, err := os.ReadFile("../docs/snippets/psql-session.sql")
	if err != nil {
		t.Fatal(err)
	}
	// Everything from the first statement on: the file's own header comment is not shown.
	start := regexp.MustCompile(`(?m)^\\set VERBOSITY`).FindIndex(script)
	out := psql(t, url, script[start[0]:], "-a")
	for _, want := range []string{"NOTICE:  idem: ops_alice released the stuck lease claim of key payout-9", "permission denied for function idem_key_body"} {
		if !strings.Contains(out, want) {
			t.Errorf("the session does not show %q", want)
		}
	}
	checkDocBlock(t, "../docs/sql-api.md", "<!-- psql-session:begin", "<!-- psql-session:end -->", "```text\n"+out+"```\n")
}

// pgCronRecipe is the part of docs/snippets/pg_cron.sql that docs/sql-api.md shows: from its
// first step on (the file's header comment is not shown).
func pgCronRecipe(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile("../docs/snippets/pg_cron.sql")
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(string(raw), "-- As a superuser")
	if i < 0 {
		t.Fatal("docs/snippets/pg_cron.sql has no step for the superuser")
	}
	return string(raw[i:])
}

// TestPgCronSnippetMatchesDocs: the pg_cron recipe in docs/sql-api.md is the one the pg_cron
// test runs (docs/snippets/pg_cron.sql).
func TestPgCronSnippetMatchesDocs(t *testing.T) {
	t.Parallel()
	checkDocBlock(t, "../docs/sql-api.md", "<!-- pg_cron:begin", "<!-- pg_cron:end -->", "```sql\n"+pgCronRecipe(t)+"```\n")
}

// TestOperationsSQLRuns runs every sql block of docs/operations.md, in order, with psql on a
// migrated database (stopping at the first error), and checks what the fillfactor block does:
// the table's fillfactor is the one it sets.
func TestOperationsSQLRuns(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?ms)^ *```sql\n(.*?)^ *```").FindAllStringSubmatch(string(raw), -1)
	if len(blocks) == 0 {
		t.Fatal("no sql block in docs/operations.md")
	}
	url := pgtest.NewDB(t)
	conn := pgtest.Connect(t, url)
	// Roles belong to the cluster, not to the test's database: the ones the blocks create are
	// dropped again, so that a second run on the same server (TEST_DATABASE_URL) finds none.
	for _, m := range regexp.MustCompile(`(?i)CREATE ROLE (\w+)`).FindAllStringSubmatch(string(raw), -1) {
		t.Cleanup(func() {
			if _, err := conn.Exec(context.Background(), `DROP ROLE IF EXISTS `+m[1]); err != nil {
				t.Errorf("dropping the role the docs created: %v", err)
			}
		})
	}
	for _, b := range blocks {
		psql(t, url, []byte(b[1]), "-v", "ON_ERROR_STOP=1")
	}
	var opts []string
	if err := conn.QueryRow(context.Background(), `SELECT reloptions FROM pg_class WHERE oid = 'idem.idempotency_keys'::regclass`).Scan(&opts); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(opts, "fillfactor=85") {
		t.Fatalf("reloptions after the documented ALTER TABLE: %v", opts)
	}
}

// TestRecoveryClaimSQLRuns runs the lease claim with its recovery points that docs/sql-api.md
// shows (idem_begin and idem_recovery in one statement) as idem_app: a fresh claim reads no
// step; a takeover of the same generation reads the step recorded; a replay and an
// in_progress answer do not call idem_recovery (it would raise 55000 for them).
func TestRecoveryClaimSQLRuns(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../docs/sql-api.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block := replaceBlock(t, string(raw), "<!-- recovery-claim:begin", "<!-- recovery-claim:end -->", "")
	m := regexp.MustCompile("(?s)```sql\n(.*?);\n```").FindStringSubmatch(block)
	if m == nil {
		t.Fatalf("no sql block between the recovery-claim markers:\n%s", block)
	}
	claim := m[1]
	km := regexp.MustCompile(`p_key => '([^']+)'`).FindStringSubmatch(claim)
	if km == nil {
		t.Fatalf("no p_key in the documented claim:\n%s", claim)
	}
	key := km[1]
	ctx := context.Background()
	url := pgtest.NewDB(t)
	admin := pgtest.Connect(t, url)
	// A reader runs the page from the top in one database: "The life of a key" first. The
	// claim of work in steps once reused its key for another action and answered mismatch.
	_, life := replaceBlock(t, string(raw), "<!-- life-of-a-key:begin", "<!-- life-of-a-key:end -->", "")
	lm := regexp.MustCompile("(?s)```sql\n(.*?)```").FindStringSubmatch(life)
	if lm == nil {
		t.Fatalf("no sql block between the life-of-a-key markers:\n%s", life)
	}
	psql(t, pgtest.LoginRole(t, url, "idem_app"), []byte(lm[1]), "-v", "ON_ERROR_STOP=1")
	app := pgtest.Connect(t, url)
	pgtest.Exec(t, app, `SET ROLE idem_app`)
	type row struct {
		outcome string
		attempt *int64
		pk      *string
		point   *string
		saved   *string
	}
	run := func() row {
		t.Helper()
		var r row
		if err := app.QueryRow(ctx, claim).Scan(&r.outcome, &r.attempt, &r.pk, &r.point, &r.saved); err != nil {
			t.Fatalf("the documented claim: %v", err)
		}
		return r
	}
	first := run()
	if first.outcome != "claimed" || first.point != nil || first.saved != nil {
		t.Fatalf("a fresh claim: %s, recovery %v %v; want claimed without steps", first.outcome, first.point, first.saved)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_step('alice', $1, $2, 'reserve', '{"id": 41}')`, key, *first.attempt)
	if r := run(); r.outcome != "in_progress" || r.point != nil {
		t.Fatalf("a duplicate while the lease runs: %s, recovery %v; want in_progress without steps", r.outcome, r.point)
	}
	pgtest.Exec(t, admin, `UPDATE idem.idempotency_keys SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE key = $1`, key)
	took := run()
	if took.outcome != "claimed" || took.point == nil || *took.point != "reserve" || took.saved == nil ||
		*took.saved != `{"reserve": {"id": 41}}` || *took.pk != *first.pk {
		t.Fatalf("the takeover: %s, recovery %v %v, provider key %v (first %v); want claimed after step reserve, the same provider key",
			took.outcome, took.point, took.saved, took.pk, first.pk)
	}
	pgtest.Exec(t, app, `SELECT idem.idem_complete('alice', $1, $2, 201, '{}', 'paid')`, key, *took.attempt)
	if r := run(); r.outcome != "replay" || r.point != nil {
		t.Fatalf("a repeat after the answer: %s, recovery %v; want replay without steps", r.outcome, r.point)
	}
}

// TestLifeOfAKeyRunsAsTheApp runs docs/sql-api.md's "The life of a key" as psql does, as a
// login role that is only a member of idem_app: the claim commits with its answer, and the
// same request then replays it. It held a placeholder (<attempt>) that psql refused.
func TestLifeOfAKeyRunsAsTheApp(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("../docs/sql-api.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block := replaceBlock(t, string(raw), "<!-- life-of-a-key:begin", "<!-- life-of-a-key:end -->", "")
	m := regexp.MustCompile("(?s)```sql\n(.*?)```").FindStringSubmatch(block)
	if m == nil {
		t.Fatalf("no sql block between the life-of-a-key markers:\n%s", block)
	}
	url := pgtest.NewDB(t)
	app := pgtest.LoginRole(t, url, "idem_app")
	psql(t, app, []byte(m[1]), "-v", "ON_ERROR_STOP=1")
	admin := pgtest.Connect(t, url)
	if n := pgtest.Count(t, admin, `SELECT count(*) FROM idem.idempotency_keys WHERE principal_id = 'alice' AND key = 'k1'
		AND state = 'c' AND response_status = 201 AND convert_from(response_body, 'UTF8') = '{"id":1}'`); n != 1 {
		t.Fatalf("%d completed rows for the documented key; want its answer stored once", n)
	}
	out := psql(t, app, []byte(`SELECT outcome, response_status FROM idem.idem_begin(p_principal => 'alice', p_key => 'k1',
		p_action => 'POST /v1/transfers', p_request_sha256 => sha256('...'::bytea));`), "-v", "ON_ERROR_STOP=1", "-At")
	if strings.TrimSpace(out) != "replay|201" {
		t.Errorf("the same request again: %q, want replay|201", out)
	}
}
