package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/gorilla/mux"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	idemhttp "github.com/pgidem/pgidem/internal/http"
)

// roundTrips counts the round trips pgx makes: every query (Exec, Query, QueryRow), every
// batch (one pipeline) and every statement it prepares.
type roundTrips struct{ n atomic.Int64 }

var (
	_ pgx.QueryTracer   = (*roundTrips)(nil)
	_ pgx.BatchTracer   = (*roundTrips)(nil)
	_ pgx.PrepareTracer = (*roundTrips)(nil)
)

func (t *roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	t.n.Add(1)
	return ctx
}

func (t *roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (t *roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	t.n.Add(1)
	return ctx
}

func (t *roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (t *roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (t *roundTrips) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	return ctx
}

// TracePrepareEnd counts a statement that was sent to be prepared (not one found prepared).
func (t *roundTrips) TracePrepareEnd(_ context.Context, _ *pgx.Conn, data pgx.TracePrepareEndData) {
	if !data.AlreadyPrepared {
		t.n.Add(1)
	}
}

// roundTripsPart counts what a keyed request adds to the same unkeyed one through the
// idemhttp middleware, in process.
func roundTripsPart(ctx context.Context, b *bench) error {
	if err := b.database(ctx, "bench"); err != nil {
		return err
	}
	tracer := &roundTrips{}
	// One connection, so that the warm-up fills the statement cache the counted requests
	// use, and no liveness ping (it is no part of a request).
	pool, err := openPool(ctx, b.url, "bench", 1, func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = tracer
		c.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	})
	if err != nil {
		return err
	}
	defer pool.Close()
	m, err := idemhttp.New(idemhttp.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return principal, true },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		return err
	}
	router := mux.NewRouter()
	router.Handle(path, m.Route(idemhttp.Route{})(http.HandlerFunc(transferHandler))).Methods(http.MethodPost)

	var w worker
	send := func(key string) (int64, error) {
		body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, 1+len(key)%7, 2+len(key)%5)
		req := httptest.NewRequestWithContext(ctx, http.MethodPost, path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		rec := httptest.NewRecorder()
		before := tracer.n.Load()
		router.ServeHTTP(rec, req)
		if rec.Code != http.StatusCreated {
			return 0, fmt.Errorf("%s request: %d %s", map[bool]string{true: "keyed", false: "unkeyed"}[key != ""], rec.Code, rec.Body)
		}
		return tracer.n.Load() - before, nil
	}
	w.rng = newRand()
	for _, key := range []string{w.key(), ""} { // warm up: statement cache, the SQL API's defaults
		if _, err := send(key); err != nil {
			return err
		}
	}
	keyed, err := send(w.key())
	if err != nil {
		return err
	}
	unkeyed, err := send("")
	if err != nil {
		return err
	}
	fmt.Printf("round trips (pgx tracer: queries, batches, prepares): keyed request %d, unkeyed request %d\n", keyed, unkeyed)
	b.info("round trips of a keyed / unkeyed request (middleware)", fmt.Sprintf("%d / %d", keyed, unkeyed))
	b.check("round trips a keyed request adds", fmt.Sprint(keyed-unkeyed), float64(keyed-unkeyed), "=", 0, "%.0f")
	return nil
}

// transferHandler does the effect through the request's transaction and answers 201.
func transferHandler(w http.ResponseWriter, r *http.Request) {
	var in struct {
		From   int `json:"from"`
		To     int `json:"to"`
		Amount int `json:"amount"`
	}
	if !idemhttp.DecodeJSON(w, r, &in) {
		return
	}
	ctx := r.Context()
	tx := idemhttp.Tx(ctx)
	if err := effect(ctx, tx, in.From, in.To); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(responseBody)
}
