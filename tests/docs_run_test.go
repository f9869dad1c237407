package tests

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// docClaim claims (lease when lease is true) or answers key as principal alice through q,
// with the request body, and returns outcome, token and provider key.
func docClaim(t *testing.T, q pgtest.Querier, key, body string, lease bool) (string, int64, string) {
	t.Helper()
	var outcome, pk string
	var attempt int64
	l := "NULL"
	if lease {
		l = "interval '1 minute'"
	}
	if err := q.QueryRow(context.Background(), `SELECT outcome, attempt, coalesce(provider_key, '') FROM idem.idem_begin('alice', $1,
		'POST /payouts', sha256(convert_to($2, 'UTF8')), p_lease => `+l+`)`, key, body).Scan(&outcome, &attempt, &pk); err != nil {
		t.Fatalf("claim %s: %v", key, err)
	}
	return outcome, attempt, pk
}

// TestDocDumpOfSchemaIdemRestores: docs/sql-api.md, "Generations and
// provider keys": "A dump of schema `idem` (`pg_dump -n idem`) restores with its grants:
// create the roles it names (`idem_app`, `idem_operator`, the owner) on the target cluster
// first, or the grants fail and the service's role cannot call the API. The copy goes on with
// the original's token sequence, so its keys replay and their tokens stay unique in it."
// No test ran that command. Here: schema idem installed by an owner that is no superuser,
// keys answered and a lease in progress as a login role in idem_app; `pg_dump -n idem` of it,
// restored with psql (ON_ERROR_STOP) into an empty database of the same cluster (the roles
// exist); then, as the service's and the operator's login roles of the copy: the schema
// checks, the answered key replays byte for byte, the lease is in progress with its provider
// key, the operator lists it, and a new claim draws a token above every token of the original.
func TestDocDumpOfSchemaIdemRestores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	src := pgtest.NewEmptyDB(t)
	ownerURL := pgtest.OwnerRole(t, src)
	psql(t, ownerURL, nil, "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql")
	appURL := pgtest.LoginRole(t, src, "idem_app")
	opURL := pgtest.LoginRole(t, src, "idem_operator")
	app := pgtest.Connect(t, appURL)

	// An answered key and a lease in progress.
	tx, err := app.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	outcome, tok, pkDone := docClaim(t, tx, "done", "100", false)
	if outcome != "claimed" {
		t.Fatalf("done: %s", outcome)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.idem_complete('alice', 'done', $1, 201, '{"Content-Type":"application/json"}', '{"id":1}')`, tok); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	outcome, leaseTok, pkLease := docClaim(t, app, "running", "200", true)
	if outcome != "claimed" {
		t.Fatalf("running: %s", outcome)
	}
	maxTok := max(tok, leaseTok)

	// pg_dump -n idem, as the docs say; restored into an empty database of the cluster.
	bin, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(src)
	if err != nil {
		t.Fatal(err)
	}
	dumpFile := filepath.Join(t.TempDir(), "idem.sql")
	dump := exec.Command(filepath.Join(bin, "pg_dump"), "-n", "idem", "-f", dumpFile)
	dump.Env = append(os.Environ(), "PGHOST="+cfg.Host, "PGPORT="+strconv.Itoa(int(cfg.Port)), "PGUSER="+cfg.User,
		"PGPASSWORD="+cfg.Password, "PGDATABASE="+cfg.Database)
	if out, err := dump.CombinedOutput(); err != nil {
		t.Fatalf("pg_dump -n idem: %v\n%s", err, out)
	}
	dst := pgtest.NewEmptyDB(t)
	ownerCfg, err := pgx.ParseConfig(ownerURL)
	if err != nil {
		t.Fatal(err)
	}
	// What the restore gives the source's owner in the copy goes back before OwnerRole's
	// cleanup drops the role (t.Cleanup runs last-in first-out).
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), dst)
		if err != nil {
			return
		}
		defer c.Close(context.Background())
		_, _ = c.Exec(context.Background(), `DROP SCHEMA IF EXISTS idem CASCADE; DROP OWNED BY `+ownerCfg.User)
	})
	out := psql(t, dst, nil, "-v", "ON_ERROR_STOP=1", "-f", dumpFile)
	if strings.Contains(out, "ERROR") {
		t.Fatalf("the restore: %s", out)
	}

	// The copy, as the roles the docs name.
	capp := pgtest.Connect(t, pgtest.AsRole(t, dst, mustUser(t, appURL), "app-secret"))
	if err := idem.CheckSchema(ctx, capp); err != nil {
		t.Fatalf("CheckSchema as the service's role on the restored copy: %v", err)
	}
	var status int
	var body string
	var pk string
	if err := capp.QueryRow(ctx, `SELECT outcome, response_status, convert_from(response_body, 'UTF8'), provider_key FROM idem.idem_begin('alice', 'done',
		'POST /payouts', sha256(convert_to('100', 'UTF8')))`).Scan(&outcome, &status, &body, &pk); err != nil {
		t.Fatalf("the answered key on the copy: %v", err)
	}
	if outcome != "replay" || status != 201 || body != `{"id":1}` || pk != pkDone {
		t.Errorf("the answered key on the copy: %s %d %s %s; want replay 201 {\"id\":1} %s", outcome, status, body, pk, pkDone)
	}
	if o, a, p := docClaim(t, capp, "running", "200", true); o != "in_progress" || a != leaseTok || p != pkLease {
		t.Errorf("the lease on the copy: %s token %d pk %s; want in_progress, token %d, pk %s", o, a, p, leaseTok, pkLease)
	}
	cop := pgtest.Connect(t, pgtest.AsRole(t, dst, mustUser(t, opURL), "app-secret"))
	if stuck, err := idem.ReadStuck(ctx, cop, 0, 0); err != nil || len(stuck) != 1 || stuck[0].Attempt != leaseTok {
		t.Errorf("the operator on the copy: %+v %v", stuck, err)
	}
	if o, a, _ := docClaim(t, capp, "new", "300", true); o != "claimed" || a <= maxTok {
		t.Errorf("a new claim on the copy: %s token %d; want claimed above %d", o, a, maxTok)
	}

	// "Give a copy a secret of its own once, before it serves, as the schema's owner and
	// outside a transaction block": the block of docs/sql-api.md, with psql, as the owner.
	secret := docBlock(t, "../docs/sql-api.md", "Give a copy a secret of its own once", "sql")
	psql(t, pgtest.AsRole(t, dst, ownerCfg.User, "app-secret"), []byte(secret), "-v", "ON_ERROR_STOP=1")
	_, _, pkSrc := docClaim(t, app, "after-secret", "400", true)
	_, _, pkDst := docClaim(t, capp, "after-secret", "400", true)
	if pkSrc == pkDst {
		t.Errorf("after its own secret the copy still gives the original's provider key %s", pkDst)
	}
	if o, _, p := docClaim(t, capp, "running", "200", true); o != "in_progress" || p != pkLease {
		t.Errorf("the lease on the copy after its own secret: %s pk %s; want in_progress, pk %s", o, p, pkLease)
	}
}

// mustUser is the user of a connection string.
func mustUser(t *testing.T, url string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	return cfg.User
}

// docBlock returns the first fenced block of kind fence in path after the marker.
func docBlock(t *testing.T, path, marker, fence string) string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(raw), marker)
	if !ok {
		t.Fatalf("%s has no %q", path, marker)
	}
	_, rest, ok = strings.Cut(rest, "```"+fence+"\n")
	block, _, ok2 := strings.Cut(rest, "```\n")
	if !ok || !ok2 {
		t.Fatalf("%s has no %s block after %q", path, fence, marker)
	}
	return block
}

// TestDocPgBouncerIniAndURL: docs/operations.md, "Behind PgBouncer", shows "A working
// `pgbouncer.ini`" and then the servers' DATABASE_URL through it (sslmode=require,
// default_query_exec_mode=exec). Both are taken from the doc at test time and run with only the
// addresses, the files' paths and the role substituted (the role: a login role in idem_app with
// its password in the auth file, as auth_type = scram-sha-256 needs; the key and certificate:
// made here): PgBouncer 1.18 with the doc's ini, the doc's URL through it as pgx opens it, over
// TLS, then a claim and its answer. The ini had no client_tls_* settings, and the URL's
// sslmode=require failed to connect ("server refused TLS connection").
func TestDocPgBouncerIniAndURL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	bin, err := pgbouncer.Binary()
	if err != nil {
		t.Fatal(err)
	}
	ini := docBlock(t, "../docs/operations.md", "<!-- pgbouncer:begin -->", "ini")
	url := strings.TrimSpace(docBlock(t, "../docs/operations.md", "The servers connect to PgBouncer", "sh"))

	db := pgtest.NewDB(t)
	appURL := pgtest.LoginRole(t, db, "idem_app")
	srv, err := pgx.ParseConfig(db)
	if err != nil {
		t.Fatal(err)
	}
	user := mustUser(t, appURL)
	port, err := pgcluster.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "docs-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for from, to := range map[string]string{
		"* = host=db.internal port=5432":                      "* = host=" + srv.Host + " port=" + strconv.Itoa(int(srv.Port)),
		"listen_addr = 0.0.0.0":                               "listen_addr = 127.0.0.1",
		"listen_port = 6432":                                  "listen_port = " + strconv.Itoa(port),
		"auth_file = /etc/pgbouncer/userlist.txt":             "auth_file = " + filepath.Join(dir, "userlist.txt"),
		"client_tls_key_file = /etc/pgbouncer/pgbouncer.key":  "client_tls_key_file = " + filepath.Join(dir, "pgbouncer.key"),
		"client_tls_cert_file = /etc/pgbouncer/pgbouncer.crt": "client_tls_cert_file = " + filepath.Join(dir, "pgbouncer.crt"),
	} {
		if !strings.Contains(ini, from) {
			t.Fatalf("the doc's pgbouncer.ini has no %q:\n%s", from, ini)
		}
		ini = strings.Replace(ini, from, to, 1)
	}
	// Where this private PgBouncer writes (not the system's directories), nothing else.
	ini += "unix_socket_dir =\nlogfile = " + filepath.Join(dir, "pgbouncer.log") + "\n"
	key, cert := selfSignedPEM(t, "pgbouncer.internal")
	files := map[string]string{"pgbouncer.ini": ini, "userlist.txt": `"` + user + `" "app-secret"` + "\n",
		"pgbouncer.key": key, "pgbouncer.crt": cert}
	cred, uid, gid, err := pgcluster.PostgresUser("pgbouncer")
	if err != nil {
		t.Fatal(err)
	}
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
		if cred != nil {
			if err := os.Chown(filepath.Join(dir, name), uid, gid); err != nil {
				t.Fatal(err)
			}
		}
	}
	if cred != nil {
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() })
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
			t.Fatalf("PgBouncer with the doc's ini does not listen:\n%s\n%s", out.String(), log)
		}
	}

	// The doc's DATABASE_URL, its addresses and role substituted.
	const docTarget = "ledger:SECRET@pgbouncer.internal:6432/ledger"
	if !strings.Contains(url, docTarget) {
		t.Fatalf("the doc's DATABASE_URL changed: %s", url)
	}
	url = strings.Trim(strings.TrimPrefix(url, "DATABASE_URL="), "'")
	url = strings.Replace(url, docTarget, user+":app-secret@"+addr+"/"+srv.Database, 1)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
		t.Fatalf("the doc's DATABASE_URL through the doc's pgbouncer.ini: %v\n%s", err, log)
	}
	if _, isTLS := conn.PgConn().Conn().(*tls.Conn); !isTLS {
		t.Errorf("the doc's DATABASE_URL (sslmode=require) connected without TLS")
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d, err := idem.Begin(ctx, tx, idem.Claim{Principal: "alice", Key: "k1", Action: "POST /x",
		Fingerprint: idem.ComputeFingerprint("POST", "/x", nil).Sum})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("a claim through PgBouncer: %+v %v", d, err)
	}
	if err := idem.Complete(ctx, tx, "alice", "k1", d.Attempt, idem.Response{Status: 201}); err != nil {
		t.Fatalf("its answer: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// "Put no other runtime parameters in DATABASE_URL behind PgBouncer 1.18 (search_path,
	// statement_timeout): it refuses them at connect ("unsupported startup parameter", 08P01);
	// application_name and timezone pass."
	for param, pass := range map[string]bool{"application_name=shop": true, "timezone=UTC": true,
		"search_path=public": false, "statement_timeout=5000": false} {
		c, err := pgx.Connect(ctx, url+"&"+param)
		if err == nil {
			c.Close(ctx)
		}
		if pass != (err == nil) || (err != nil && !strings.Contains(err.Error(), "unsupported startup parameter")) {
			t.Errorf("DATABASE_URL with %s through the doc's pgbouncer.ini: %v; the doc says it %s", param, err,
				map[bool]string{true: "passes", false: "is refused (unsupported startup parameter)"}[pass])
		}
	}
}

// TestDocLoginRolesAsTheCreateRoleOwner: docs/sql-api.md, "Installing
// without a superuser": "Instead of creating the two roles, the superuser may give the owner
// CREATEROLE (`CREATE ROLE shop_owner LOGIN CREATEROLE ...`); the owner's install then creates
// them, and the owner can make the login roles below itself", and the login-roles block runs
// "as a superuser, or as a role with CREATEROLE". TestInstallWithoutSuperuser runs that block
// as a superuser only, and its CREATEROLE owner makes a login role of its own text. Here, on a
// cluster of its own where neither role exists: shop_owner with CREATEROLE, the install with
// psql -f sql/idem.sql as shop_owner, the doc's login-roles block verbatim as shop_owner, then
// shop_app claims a key with the settings the block gave it and ops_alice lists it.
func TestDocLoginRolesAsTheCreateRoleOwner(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, stop, err := pgcluster.StartTemp(ctx, "idem-docs-", map[string]string{"fsync": "off"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	admin := pgtest.Connect(t, c.ConnString("postgres"))
	pgtest.Exec(t, admin, `CREATE ROLE shop_owner LOGIN CREATEROLE PASSWORD 'change-me'`)
	pgtest.Exec(t, admin, `CREATE DATABASE shop OWNER shop_owner`)
	as := func(role string) string { return c.ConnString("shop") + " user=" + role + " password=change-me" }
	psql(t, as("shop_owner"), nil, "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql")
	psql(t, as("shop_owner"), []byte(docSQL(t, "login-roles")), "-v", "ON_ERROR_STOP=1")

	app := pgtest.Connect(t, as("shop_app"))
	if err := idem.CheckSchema(ctx, app); err != nil {
		t.Fatalf("CheckSchema as shop_app: %v", err)
	}
	// (tcp_user_timeout reads 0 on a Unix socket: the role's stored settings are compared.)
	var settings []string
	if err := admin.QueryRow(ctx, `SELECT setconfig FROM pg_db_role_setting WHERE setrole = 'shop_app'::regrole AND setdatabase = 0`).Scan(&settings); err != nil ||
		strings.Join(settings, ",") != "idle_in_transaction_session_timeout=60s,tcp_user_timeout=30s" {
		t.Errorf("shop_app's settings: %v %v; want the block's 60s and 30s", settings, err)
	}
	d, err := idem.Begin(ctx, app, idem.Claim{Principal: "p", Key: "k", Action: "POST /x", Lease: time.Minute,
		Fingerprint: idem.ComputeFingerprint("POST", "/x", nil).Sum})
	if err != nil || d.Outcome != idem.Claimed {
		t.Fatalf("a lease claim as shop_app: %+v %v", d, err)
	}
	ops := pgtest.Connect(t, as("ops_alice"))
	if stuck, err := idem.ReadStuck(ctx, ops, 0, 0); err != nil || len(stuck) != 1 || stuck[0].Attempt != d.Attempt {
		t.Fatalf("the claims in progress as ops_alice: %+v %v", stuck, err)
	}
}

// TestDocPsqlSessionAfterTheOwnersInstall: the psql session of
// docs/sql-api.md begins "-- Installed beforehand by the database's owner: psql -v
// ON_ERROR_STOP=1 -f sql/idem.sql". TestPsqlSessionMatchesDocs installs with idemsql.Migrate as
// the test server's superuser instead. Here the install is the one the session names (psql -f
// sql/idem.sql, as an owner that is no superuser), and the session's output is compared with
// the doc's copy as TestPsqlSessionMatchesDocs compares it.
func TestDocPsqlSessionAfterTheOwnersInstall(t *testing.T) {
	t.Parallel()
	url := pgtest.NewEmptyDB(t)
	owner := pgtest.OwnerRole(t, url)
	psql(t, owner, nil, "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql")
	psqlRoles(t, url)
	script, err := os.ReadFile("../docs/snippets/psql-session.sql")
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(string(script), `\set VERBOSITY`)
	out := psql(t, url, script[i:], "-a")
	raw, err := os.ReadFile("../docs/sql-api.md")
	if err != nil {
		t.Fatal(err)
	}
	_, have := replaceBlock(t, string(raw), "<!-- psql-session:begin", "<!-- psql-session:end -->", "")
	if want := "```text\n" + out + "```\n"; have != want {
		t.Errorf("the session after the owner's psql install differs from docs/sql-api.md:\n--- got:\n%s--- doc:\n%s", want, have)
	}
}

// TestDocFillfactorAsTheOwnerSurvivesTheNextInstall: docs/operations.md,
// "The fillfactor": "check the share of HOT completions and lower the fillfactor" with its sql
// block (the HOT share, then ALTER TABLE idem.idempotency_keys SET (fillfactor = 85)).
// TestOperationsSQLRuns runs the block as the test server's superuser; only the table's owner
// may alter it. Here the block, taken from the doc, runs with psql as an owner that is no
// superuser, and the next install (an upgrade's psql -f sql/idem.sql, which "re-installs the
// functions") keeps the setting the operator chose.
func TestDocFillfactorAsTheOwnerSurvivesTheNextInstall(t *testing.T) {
	t.Parallel()
	url := pgtest.NewEmptyDB(t)
	owner := pgtest.OwnerRole(t, url)
	psql(t, owner, nil, "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql")
	block := docBlock(t, "../docs/operations.md", "**The fillfactor.**", "sql")
	psql(t, owner, []byte(block), "-v", "ON_ERROR_STOP=1")
	psql(t, owner, nil, "-v", "ON_ERROR_STOP=1", "-f", "../sql/idem.sql")
	conn := pgtest.Connect(t, owner)
	var opts []string
	if err := conn.QueryRow(context.Background(), `SELECT reloptions FROM pg_class WHERE oid = 'idem.idempotency_keys'::regclass`).Scan(&opts); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(opts, "fillfactor=85") {
		t.Errorf("reloptions after the documented ALTER TABLE and the next install: %v", opts)
	}
}

// selfSignedPEM makes a private key and a self-signed certificate for host, in PEM.
func selfSignedPEM(t *testing.T, host string) (key, cert string) {
	t.Helper()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: host},
		DNSNames:     []string{host},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &priv.PublicKey, priv)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder})),
		string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}
