// Command shop is a small service that takes orders, made safe to retry with idem: its own
// table, the middleware on net/http's ServeMux, the cleaner of expired keys, and two roles. The
// database's owner runs the migrate step (./migrate: schema idem and the shop's table) once
// per release; the service logs in as a role that is only a member of idem_app, and checks at
// start that the schema is the one it needs (it links no migration code).
//
//	DATABASE_URL=postgres://shop_owner@localhost/shop go run ./migrate   # as the owner
//	DATABASE_URL=postgres://shop_app@localhost/shop LISTEN_ADDR=127.0.0.1:8081 go run .
//	curl -s localhost:8081/orders -H 'X-Customer: c1' -H 'Idempotency-Key: o-1' -H 'Content-Type: application/json' -d '{"sku":"a1","qty":2}'
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Getenv("DATABASE_URL"), os.Getenv("LISTEN_ADDR")); err != nil {
		log.Fatal(err)
	}
}

// run serves until ctx ends.
func run(ctx context.Context, databaseURL, addr string) error {
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := newShop(ctx, pool)
	if err != nil {
		return err // a database that is not migrated says so here, with what to run
	}
	defer s.cleaner.Stop()
	srv := &http.Server{Addr: addr, Handler: s.handler, ReadHeaderTimeout: 10 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.ListenAndServe() }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	work := make(chan error, 1)
	go func() { work <- s.idem.Shutdown(sctx) }() // keyed work in flight, duplicates waiting
	err = srv.Shutdown(sctx)
	if werr := <-work; werr != nil { // the keyed work still running was ended, and answered
		log.Printf("shutdown: keyed work still running at the deadline was ended: %v", werr)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		err = srv.Close() // past the deadline: a stop all the same; what is left is cut
	}
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// shop is the service: its routes, the idempotency middleware and the cleaner.
type shop struct {
	handler http.Handler
	idem    *idem.Middleware
	cleaner *idem.Cleaner
}

// newShop checks the schema (idem.New does), starts the cleaner and returns the shop's routes.
func newShop(ctx context.Context, pool *pgxpool.Pool) (*shop, error) {
	m, err := idem.New(ctx, idem.Options{
		DB: pool,
		// Who sent the request: your authentication. Keys belong to it.
		Principal: func(r *http.Request) (string, bool) {
			c := r.Header.Get("X-Customer")
			return c, c != ""
		},
	})
	if err != nil {
		return nil, err
	}
	// Expired keys are deleted every minute, paced, one pass at a time across processes:
	// without it the key table grows forever.
	cleaner, err := idem.StartCleaner(ctx, pool, idem.CleanerOptions{})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(createOrder)))
	return &shop{handler: mux, idem: m, cleaner: cleaner}, nil
}

// createOrder writes through the request's transaction, which commits with the key.
func createOrder(w http.ResponseWriter, r *http.Request) {
	customer, ok := idem.ClaimOf(r.Context())
	// On this Required route every request with a principal has a claim, so no claim means no
	// customer. On a route whose key is optional, a request without a key has no claim either:
	// read the principal from your own authentication there, not from ClaimOf.
	if !ok {
		http.Error(w, "say who you are (X-Customer)", http.StatusUnauthorized)
		return
	}
	var o struct {
		SKU string `json:"sku"`
		Qty int    `json:"qty"`
	}
	if !idem.DecodeJSON(w, r, &o) { // 400 or 415, stored as the answer
		return
	}
	if o.SKU == "" || o.Qty < 1 {
		idem.WriteProblem(w, http.StatusUnprocessableEntity, "https://shop.example/problems#", "invalid_order",
			"Invalid order", "sku and a positive qty are required", "") // 422: stored and replayed
		return
	}
	var id int64
	err := idem.TxFrom(r.Context()).QueryRow(r.Context(),
		`INSERT INTO orders (customer, sku, qty) VALUES ($1, $2, $3) RETURNING id`, customer.Principal, o.SKU, o.Qty).Scan(&id)
	if err != nil {
		http.Error(w, "try again", http.StatusInternalServerError) // rolled back, not stored
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"sku":%q,"qty":%d}`, id, o.SKU, o.Qty)
}
