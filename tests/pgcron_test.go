package tests

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/pgcluster"
	"github.com/pgidem/pgidem/internal/pgtest"
	idemsql "github.com/pgidem/pgidem/sql"
)

// TestPgCronCleanup runs the documented pg_cron schedule, read from docs/snippets/pg_cron.sql,
// on a private cluster of its own with pg_cron loaded, and shows that one scheduled run of
// CALL idem.idem_cleanup_all(5000) deletes every expired key (12,000: three batches) and no
// live one, each batch in a transaction of its own (a statement trigger records the
// transaction of every DELETE); and that the vacuum job scheduled beside it vacuums the key
// table (pg_cron runs VACUUM outside a transaction block). pg_cron 1.4 schedules by the minute, so the run starts at
// the next full minute: this test waits up to 70 seconds.
//
// The cluster settings pg_cron needs: shared_preload_libraries = 'pg_cron' (its launcher is a
// background worker started with the server), cron.database_name (the one database whose
// cron.job table it reads; the extension is created there), and cron.host: pg_cron runs
// each job over a libpq connection of its own, as the job's user, to cron.host at the
// server's port. Here that is 127.0.0.1, the cluster's listen address, which initdb's
// pg_hba.conf trusts.
//
// It runs as the roles the recipe names: a superuser creates the roles (the documented
// superuser step) and a database owned by idem_owner, which is no superuser; idem_owner
// installs schema idem; the superuser part of the recipe (the grant on schema cron) runs as
// the superuser, the schedule as idem_owner, so the jobs run as idem_owner, the only role that
// may vacuum the key table.
func TestPgCronCleanup(t *testing.T) {
	t.Parallel()
	recipe := pgCronRecipe(t)
	bin, err := pgcluster.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(bin), "lib", "pg_cron.so")); err != nil {
		t.Fatalf("pg_cron is not installed next to %s: apt-get install postgresql-15-cron (%v)", bin, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const db = "idem_cron"
	c, stop, err := pgcluster.StartTemp(ctx, "idem-pgcron-", map[string]string{
		"shared_preload_libraries": "pg_cron",
		"cron.database_name":       db,
		"cron.host":                "127.0.0.1",
		"fsync":                    "off", "synchronous_commit": "off", "full_page_writes": "off",
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	admin := pgtest.Connect(t, c.ConnString("postgres"))
	pgtest.Exec(t, admin, `CREATE ROLE idem_app NOLOGIN; CREATE ROLE idem_operator NOLOGIN; CREATE ROLE idem_owner LOGIN`)
	pgtest.Exec(t, admin, "CREATE DATABASE "+db+" OWNER idem_owner")
	owner := pgtest.Connect(t, c.ConnString(db)+" user=idem_owner")
	if err := idemsql.Migrate(ctx, owner, idemsql.Options{}); err != nil {
		t.Fatalf("install as idem_owner: %v", err)
	}
	conn := pgtest.Connect(t, c.ConnString(db)) // the superuser, for the extension and the test's own rows
	pgtest.Exec(t, conn, "CREATE EXTENSION pg_cron")

	const expired, live = 12000, 300
	pgtest.InsertExpired(t, conn, "p", expired)
	pgtest.Exec(t, conn, `INSERT INTO idem.idempotency_keys (expires_at, attempt, action_hash, state, principal_id, key,
		request_sha256, response_status, response_headers)
		SELECT now() + interval '1 day', nextval('idem.token_seq'), 0, 'c', 'p', 'live-' || i, sha256(i::text::bytea), 200, '{}'
		  FROM generate_series(1, $1) AS i`, live)
	pgtest.Exec(t, conn, `CREATE TABLE public.cleanup_batches (txid bigint, deleted bigint);
		CREATE FUNCTION public.record_batch() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
		BEGIN
			INSERT INTO public.cleanup_batches SELECT txid_current(), count(*) FROM gone;
			RETURN NULL;
		END $$;
		CREATE TRIGGER record_batch AFTER DELETE ON idem.idempotency_keys
			REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION public.record_batch()`)

	// The documented recipe, verbatim, with psql as the superuser (the recipe switches to
	// idem_owner itself); first its schedule alone as idem_owner, which the grant is for.
	if out, err := psqlCommand(t, c.ConnString(db)+" user=idem_owner", "-X", "-v", "ON_ERROR_STOP=1", "-c",
		`SELECT cron.schedule('x', '* * * * *', 'SELECT 1')`).CombinedOutput(); err == nil || !strings.Contains(string(out), "permission denied for schema cron") {
		t.Fatalf("the schedule without the grant: %v %s, want permission denied for schema cron", err, out)
	}
	scheduled := time.Now()
	psql(t, c.ConnString(db), []byte(recipe), "-v", "ON_ERROR_STOP=1")
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM cron.job WHERE username = 'idem_owner'`); n != 2 {
		t.Fatalf("%d jobs of idem_owner, want the recipe's 2", n)
	}
	finished := func(job string) {
		t.Helper()
		var status, message string
		for deadline := scheduled.Add(70 * time.Second); ; {
			err := conn.QueryRow(ctx, `SELECT d.status, coalesce(d.return_message, '') FROM cron.job_run_details AS d
				JOIN cron.job AS j USING (jobid) WHERE j.jobname = $1 AND d.status IN ('succeeded', 'failed')
				ORDER BY d.runid LIMIT 1`, job).Scan(&status, &message)
			if err == nil {
				break
			}
			if err != pgx.ErrNoRows {
				t.Fatal(err)
			}
			if time.Now().After(deadline) {
				var runs []string
				rows, _ := conn.Query(ctx, `SELECT format('%s %s %s', status, start_time, return_message) FROM cron.job_run_details`)
				runs, _ = pgx.CollectRows(rows, pgx.RowTo[string])
				t.Fatalf("no finished run of job %s %v after scheduling it (runs: %v; server log %s)",
					job, time.Since(scheduled).Round(time.Second), runs, c.LogFile())
			}
			time.Sleep(250 * time.Millisecond)
		}
		pgtest.Exec(t, conn, `SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname = $1`, job) // no second run while we count
		t.Logf("the first run of %s finished %v after the schedule call: %s, %q",
			job, time.Since(scheduled).Round(time.Second), status, message)
		if status != "succeeded" {
			t.Fatalf("the job %s failed: %s", job, message)
		}
	}
	finished("idem-cleanup")
	finished("idem-vacuum")
	if n := pgtest.Count(t, conn, `SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = 'idem.idempotency_keys'::regclass`); n < 1 {
		t.Fatalf("the key table was vacuumed %d times, want the job's vacuum", n)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'old-%'`); n != 0 {
		t.Fatalf("%d expired keys left after one run", n)
	}
	if n := pgtest.Count(t, conn, `SELECT count(*) FROM idem.idempotency_keys WHERE key LIKE 'live-%'`); n != live {
		t.Fatalf("%d live keys, want %d", n, live)
	}
	rows, err := conn.Query(ctx, `SELECT deleted FROM public.cleanup_batches ORDER BY txid`)
	if err != nil {
		t.Fatal(err)
	}
	batches, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(batches, []int64{5000, 5000, 2000}) {
		t.Fatalf("batches %v, want 5000, 5000, 2000", batches)
	}
	if n := pgtest.Count(t, conn, `SELECT count(DISTINCT txid) FROM public.cleanup_batches`); n != 3 {
		t.Fatalf("the batches ran in %d transactions, want 3 (one each)", n)
	}
}
