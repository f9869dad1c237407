// Command shop is a small service that takes orders, made safe to retry with idem: its own
// table, the SQL API installed at start, the middleware on net/http's ServeMux.
//
//	DATABASE_URL=postgres://... LISTEN_ADDR=127.0.0.1:8081 go run .
//	curl -s localhost:8081/orders -H 'X-Customer: c1' -H 'Idempotency-Key: o-1' -H 'Content-Type: application/json' -d '{"sku":"a1","qty":2}'
package main

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/idem"
)

func main() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	handler, err := newShop(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(http.ListenAndServe(os.Getenv("LISTEN_ADDR"), handler))
}

// newShop installs the SQL API and the shop's table, and returns the shop's routes.
func newShop(ctx context.Context, pool *pgxpool.Pool) (http.Handler, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	err = idem.Migrate(ctx, conn.Conn(), idem.MigrateOptions{}) // schema idem: safe at every start
	conn.Release()
	if err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
		id bigserial PRIMARY KEY, customer text NOT NULL, sku text NOT NULL, qty int NOT NULL CHECK (qty > 0))`); err != nil {
		return nil, err
	}
	m, err := idem.New(idem.Options{
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
	mux := http.NewServeMux()
	mux.Handle("POST /orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(createOrder)))
	return mux, nil
}

// createOrder writes through the request's transaction, which commits with the key.
func createOrder(w http.ResponseWriter, r *http.Request) {
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
	customer, _ := idem.ClaimOf(r.Context())
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
