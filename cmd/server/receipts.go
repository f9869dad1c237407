package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

// Receipts: work after the answer. A transfer enqueues the job that sends its receipt (a
// webhook to RECEIPT_URL) in the transfer's own transaction (idemriver.Insert), so the job
// commits with the transfer and its key, and a replay enqueues nothing. A River worker sends
// it under a lease keyed by the job (idemriver.Work), with the claim's provider key as the
// webhook's Idempotency-Key: River's retries, and a worker killed in the middle of a send and
// rescued by River, reach the receiver under one key, which it deduplicates.

// riverSchema is the schema of River's tables (`server migrate` installs them there).
const riverSchema = "river"

// receiptArgs is a receipt job: the transfer it is the receipt of.
type receiptArgs struct {
	Principal string    `json:"principal"`
	Transfer  int64     `json:"transfer"`
	From      int64     `json:"from"`
	To        int64     `json:"to"`
	Amount    int64     `json:"amount"`
	CreatedAt time.Time `json:"created_at"`
}

func (receiptArgs) Kind() string { return "receipt" }

// receiptsPrincipal owns the keys of the receipts: the server's own principal, a row of
// ledger.principals (the key table's principal_id refers to it) that no client authenticates
// as. Under a client's principal a receipt's key ("receipt/<job id>") shared the key space of
// that client's Idempotency-Keys: a client's "receipt/1" took a receipt's key (the job was
// cancelled), or the receipt took the client's (422).
const receiptsPrincipal = "server:receipts"

// receiptWorker sends a receipt to the receiver.
type receiptWorker struct {
	river.WorkerDefaults[receiptArgs]
	url     string
	http    *http.Client
	opts    idemriver.Options
	timeout time.Duration
}

// Timeout is River's job timeout for a receipt.
func (w *receiptWorker) Timeout(*river.Job[receiptArgs]) time.Duration { return w.timeout }

// Work POSTs the receipt under the job's lease, with the claim's provider key as the
// Idempotency-Key: a 2xx is the receiver's word that it has the receipt.
func (w *receiptWorker) Work(ctx context.Context, job *river.Job[receiptArgs]) error {
	body, err := json.Marshal(job.Args)
	if err != nil {
		return river.JobCancel(err)
	}
	return idemriver.Work(ctx, job.JobRow, w.opts, func(ctx context.Context, claim idem.LeaseClaim) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.url, bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", claim.ProviderKey)
		res, err := w.http.Do(req)
		if err != nil {
			return err
		}
		defer res.Body.Close()
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 1<<16))
		if res.StatusCode/100 != 2 {
			return fmt.Errorf("receipt of transfer %d: the receiver answered %s", job.Args.Transfer, res.Status)
		}
		return nil
	})
}

// migrateRiver installs or upgrades River's tables in schema river and lets the application
// role use them (insert jobs in a transfer's transaction, work them).
func (m *Main) migrateRiver(ctx context.Context) error {
	if _, err := m.pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+riverSchema); err != nil {
		return fmt.Errorf("river migrate: %w", err)
	}
	mig, err := rivermigrate.New(riverpgxv5.New(m.pool), &rivermigrate.Config{Schema: riverSchema, Logger: m.log})
	if err != nil {
		return fmt.Errorf("river migrate: %w", err)
	}
	if _, err := mig.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("river migrate: %w", err)
	}
	role := pgx.Identifier{m.Config.AppRole}.Sanitize()
	if _, err := m.pool.Exec(ctx, `DO $$ BEGIN
			IF EXISTS (SELECT FROM pg_roles WHERE rolname = '`+m.Config.AppRole+`') THEN
				GRANT USAGE ON SCHEMA `+riverSchema+` TO `+role+`;
				GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA `+riverSchema+` TO `+role+`;
				GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA `+riverSchema+` TO `+role+`;
			END IF;
		END $$`); err != nil {
		return fmt.Errorf("river migrate: grant to %s: %w", m.Config.AppRole, err)
	}
	return nil
}

// startReceipts makes the River client of the receipts when RECEIPT_URL is set (nil
// otherwise), on a pool of its own (its fetches, its notifications' connection and the
// sends' leases do not take the requests' connections), and checks that River's tables are
// there. Start it after the routes are built; stop it at shutdown.
func (m *Main) startReceipts(ctx context.Context) (*river.Client[pgx.Tx], error) {
	if m.Config.ReceiptURL == "" {
		return nil, nil
	}
	var ok bool
	if err := m.pool.QueryRow(ctx, `SELECT to_regclass('`+riverSchema+`.river_job') IS NOT NULL`).Scan(&ok); err != nil {
		return nil, fmt.Errorf("check River's tables: %w", err)
	}
	if !ok {
		return nil, fmt.Errorf("%w (RECEIPT_URL is set and River's tables, schema %s, are missing)", errNotMigrated, riverSchema)
	}
	cfg := m.pool.Config().Copy()
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	m.riverPool = pool
	// The receipts' principal, written once (read first: a server that starts on a database
	// that takes no writes at the moment still starts once it is there).
	var there bool
	err = pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM ledger.principals WHERE id = $1)`, receiptsPrincipal).Scan(&there)
	if err == nil && !there {
		_, err = pool.Exec(ctx, `INSERT INTO ledger.principals (id, name) VALUES ($1, 'the server''s receipts')
			ON CONFLICT (id) DO NOTHING`, receiptsPrincipal)
	}
	if err != nil {
		return nil, fmt.Errorf("the receipts' principal %s: %w", receiptsPrincipal, err)
	}
	workers := river.NewWorkers()
	river.AddWorker(workers, &receiptWorker{url: m.Config.ReceiptURL, http: &http.Client{}, timeout: m.Config.ReceiptTimeout,
		opts: idemriver.Options{DB: pool, Lease: m.Config.ReceiptLease, Principal: receiptsPrincipal}})
	return river.NewClient(riverpgxv5.New(pool), &river.Config{
		Schema:               riverSchema,
		Queues:               map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 2}},
		Workers:              workers,
		JobTimeout:           m.Config.ReceiptTimeout,
		RescueStuckJobsAfter: m.Config.ReceiptRescueAfter,
		Logger:               m.log.With(slog.String("component", "river")),
	})
}

// receiptsRetryEvery is how often the receipts' River client tries to start again on a
// database that takes no writes.
const receiptsRetryEvery = 5 * time.Second

// runReceipts starts the receipts' River client. It is stopped by stopReceipts, after the HTTP
// server: not by the end of ctx, which would cut the sends short before the requests that
// enqueue them are done. River writes as it starts (its queues, its leader): on a database
// that takes no writes at the moment (25006: a standby not yet promoted, a read-only spell)
// the server starts without it, says so, and tries again every receiptsRetryEvery until it
// starts or the server stops (D214). Any other failure stops the start.
func (m *Main) runReceipts(ctx context.Context) error {
	err := m.receipts.Start(context.WithoutCancel(ctx))
	if err == nil {
		return nil
	}
	if pgErr := (*pgconn.PgError)(nil); !errors.As(err, &pgErr) || pgErr.Code != "25006" {
		return fmt.Errorf("start the receipts' River client: %w", err)
	}
	m.log.Warn("the receipts' River client cannot start on a database that takes no writes; receipts wait, trying again",
		"every", receiptsRetryEvery.String(), "error", err)
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	done := make(chan struct{})
	m.receiptsRetry = func() { cancel(); <-done }
	go func() {
		defer close(done)
		t := time.NewTicker(receiptsRetryEvery)
		defer t.Stop()
		for {
			select {
			case <-rctx.Done():
				return
			case <-t.C:
			}
			// On fresh connections: a session opened while the database took no writes can
			// keep that as its default (default_transaction_read_only set for the database).
			m.riverPool.Reset()
			if err := m.receipts.Start(context.WithoutCancel(ctx)); err == nil {
				m.log.Info("the receipts' River client started")
				return
			}
		}
	}()
	return nil
}

// stopReceipts stops the receipts' River client, if any: the sends running finish until ctx
// ends; then they are cancelled, and each gives its lease up for River's retry.
func (m *Main) stopReceipts(ctx context.Context) {
	if m.receipts == nil {
		return
	}
	if m.receiptsRetry != nil {
		m.receiptsRetry() // no start after the stop below
	}
	if err := m.receipts.Stop(ctx); err != nil {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := m.receipts.StopAndCancel(cctx); err != nil {
			m.log.Warn("the receipts' River client did not stop", "error", err)
		}
	}
}
