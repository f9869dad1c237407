// Package release010 is release 0.1.0 of idem as it served: its SQL (sql/: the idem
// migrations and functions, and the reference server's ledger migration, never edited) installed
// as that release's `server migrate` did, a fill of its key table, and its keyed deposit's
// request flow. The upgrade tests and `make bench`'s upgrade part run this previous release
// against a database while this release's migrate runs, as a rolling upgrade does.
package release010

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"

	"github.com/pgidem/pgidem/internal/canon"
)

//go:embed sql
var files embed.FS

// Install installs release 0.1.0's SQL on conn (an empty database) as that release's `server
// migrate` did: the idem migrations (version table idem.schema_version) and functions, then the
// ledger's migration (tables in schema public, version table public.ledger_schema_version).
func Install(ctx context.Context, conn *pgx.Conn) error {
	sub := func(dir string) (fs.FS, error) { return fs.Sub(files, "sql/"+dir) }
	data := map[string]any{"app_role": "idem_app"}
	if _, err := conn.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS idem`); err != nil {
		return err
	}
	for _, step := range []struct{ table, dir string }{{"idem.schema_version", "idem/migrations"}, {"public.ledger_schema_version", "ledger"}} {
		m, err := migrate.NewMigrator(ctx, conn, step.table)
		if err != nil {
			return err
		}
		m.Data = data
		dir, err := sub(step.dir)
		if err != nil {
			return err
		}
		if err := m.LoadMigrations(dir); err != nil {
			return err
		}
		if err := m.Migrate(ctx); err != nil {
			return fmt.Errorf("0.1.0 %s: %w", step.dir, err)
		}
		if step.dir == "idem/migrations" {
			dir, err := sub("idem/functions")
			if err != nil {
				return err
			}
			code, err := migrate.LoadCodePackage(dir)
			if err != nil {
				return err
			}
			if err := migrate.InstallCodePackage(ctx, conn, data, code); err != nil {
				return fmt.Errorf("0.1.0 functions: %w", err)
			}
		}
	}
	return nil
}

// Fill adds n completed keys of principal p_fill (created here) to 0.1.0's key table, as
// 0.1.0's deposits stored them, and vacuums it: the table a migrate then has to rebuild.
func Fill(ctx context.Context, conn *pgx.Conn, n int) error {
	if _, err := conn.Exec(ctx, `INSERT INTO principals VALUES ('p_fill', 'fill') ON CONFLICT DO NOTHING`); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `INSERT INTO idem.idempotency_keys (principal_id, key, state, attempt, created_at, expires_at,
		action, request_sha256, request_fields, completed_at, response_status, response_headers, response_body, resource_id)
		SELECT 'p_fill', 'fill-' || g, 'completed', 1, now(), now() + interval '1 day', 'POST /v1/accounts/{id}/deposits',
		       sha256(g::text::bytea), jsonb_build_object('amount', encode(sha256(g::text::bytea), 'hex')), now(), 201,
		       '{"Content-Type": "application/json", "Location": "/v1/accounts/9/deposits/1"}',
		       convert_to('{"id":' || g || ',"account_id":9,"amount":1}', 'UTF8'), g::text
		  FROM generate_series(1, $1::integer) AS g`, n); err != nil {
		return err
	}
	_, err := conn.Exec(ctx, `VACUUM ANALYZE idem.idempotency_keys`)
	return err
}

// Deposit is the keyed deposit of release 0.1.0's server into account 1 of principal, as that
// release served it (cmd/server and internal/http at commit 281238e): one transaction with
// BEGIN, idem_begin (0.1.0's signature, the fingerprint of canon), the deposit, idem_complete
// (an integer attempt) and COMMIT; a replay answers the stored response; a lock timeout is
// 409, any other failure 503 with the error in its body.
func Deposit(pool *pgxpool.Pool, principal string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		body, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		fp := canon.Compute(r.Method, r.URL.EscapedPath(), body)
		fields, _ := json.Marshal(fp.Fields)
		fail := func(err error) {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
				http.Error(w, "request_in_progress", http.StatusConflict)
				return
			}
			http.Error(w, "store_unavailable: "+err.Error(), http.StatusServiceUnavailable)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			fail(err)
			return
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		var outcome string
		var attempt int32
		var status *int32
		var stored []byte
		if err := tx.QueryRow(ctx, `SELECT outcome, attempt::integer, response_status, response_body
			FROM idem.idem_begin(p_principal => $1::text, p_key => $2::text, p_action => $3::text,
			                     p_request_sha256 => $4::bytea, p_request_fields => $5::jsonb)`,
			principal, key, "POST /v1/accounts/{id}/deposits", fp.Sum[:], string(fields)).Scan(&outcome, &attempt, &status, &stored); err != nil {
			fail(err)
			return
		}
		switch outcome {
		case "replay":
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(int(*status))
			_, _ = w.Write(stored)
			return
		case "claimed":
		default:
			http.Error(w, outcome, http.StatusConflict)
			return
		}
		var in struct{ Amount int64 }
		_ = json.Unmarshal(body, &in)
		var out struct {
			ID        int64     `json:"id"`
			AccountID int64     `json:"account_id"`
			Amount    int64     `json:"amount"`
			Balance   int64     `json:"balance"`
			CreatedAt time.Time `json:"created_at"`
		}
		if err := tx.QueryRow(ctx, `UPDATE accounts SET balance = balance + $1, version = version + 1 WHERE id = 1
			RETURNING balance`, in.Amount).Scan(&out.Balance); err != nil {
			fail(err)
			return
		}
		if err := tx.QueryRow(ctx, `INSERT INTO deposits (account_id, amount, idempotency_key) VALUES (1, $1, $2)
			RETURNING id, account_id, amount, created_at`, in.Amount, key).Scan(&out.ID, &out.AccountID, &out.Amount, &out.CreatedAt); err != nil {
			fail(err)
			return
		}
		resp, _ := json.Marshal(out)
		resp = append(resp, '\n')
		if _, err := tx.Exec(ctx, `SELECT idem.idem_complete(p_principal => $1::text, p_key => $2::text, p_attempt => $3::integer,
			p_status => 201, p_headers => $4::jsonb, p_body => $5::bytea)`, principal, key, attempt,
			`{"Content-Type": "application/json"}`, resp); err != nil {
			fail(err)
			return
		}
		if err := tx.Commit(ctx); err != nil {
			fail(err)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(resp)
	}
}
