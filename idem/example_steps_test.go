package idem_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/idem"
)

// Work in steps on a lease route: create the order, charge the card, write the receipt. Each
// step's writes commit with its recovery point. The first attempt creates the order and fails
// at the charge (the card provider is down): its 502 gives the lease up, and the client's retry
// skips the order (it gets the order's id that the step saved), charges under the request's
// provider key, and writes the receipt. One order, one charge, one receipt, one answer.
func ExampleStep() {
	ctx := context.Background()
	pool, done := exampleDB()
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE step_orders (id serial PRIMARY KEY, sku text NOT NULL);
		CREATE TABLE step_receipts (order_id int PRIMARY KEY, charge text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		log.Fatal(err)
	}
	var mu sync.Mutex
	charges, calls, down := map[string]string{}, 0, true // the card provider: its charges by its idempotency key
	charge := func(key string, amount int) (string, error) {
		mu.Lock()
		defer mu.Unlock()
		if down { // its first call fails
			down = false
			return "", errors.New("card provider unavailable")
		}
		calls++
		if _, ok := charges[key]; !ok {
			charges[key] = fmt.Sprintf("ch_%d_%d", len(charges)+1, amount)
		}
		return charges[key], nil
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", m.Route(idem.Route{Lease: 10 * time.Second, Required: true})(http.HandlerFunc(
		func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			var in struct {
				SKU    string `json:"sku"`
				Amount int    `json:"amount"`
			}
			if !idem.DecodeJSON(w, r, &in) {
				return
			}
			claim, _ := idem.ClaimOf(ctx)
			order, err := idem.Step(ctx, "order", func(ctx context.Context, tx pgx.Tx) (int, error) {
				var id int
				err := tx.QueryRow(ctx, `INSERT INTO step_orders (sku) VALUES ($1) RETURNING id`, in.SKU).Scan(&id)
				return id, err
			})
			if err != nil {
				http.Error(w, "try again", http.StatusServiceUnavailable)
				return
			}
			// An outside call, made once per request: under the provider key, its answer saved.
			ch, err := idem.Step(ctx, "charge", func(ctx context.Context, _ pgx.Tx) (string, error) {
				return charge(claim.ProviderKey, in.Amount)
			})
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway) // gives the lease up; the retry goes on from here
				return
			}
			_, err = idem.Step(ctx, "receipt", func(ctx context.Context, tx pgx.Tx) (bool, error) {
				_, err := tx.Exec(ctx, `INSERT INTO step_receipts (order_id, charge) VALUES ($1, $2)`, order, ch)
				return true, err
			})
			if err != nil {
				http.Error(w, "try again", http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"order":%d,"charge":%q}`, order, ch)
		})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 3 { // the client retries until it has an answer, and once more
		send(srv.URL+"/orders", "order-in-steps", `{"sku":"a1","amount":700}`)
	}
	var orders, receipts int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM step_orders), (SELECT count(*) FROM step_receipts)`).
		Scan(&orders, &receipts); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", orders, "charges:", len(charges), "calls that charged:", calls, "receipts:", receipts)
	// Output:
	// 502 false card provider unavailable
	// 201 false {"order":1,"charge":"ch_1_700"}
	// 201 true {"order":1,"charge":"ch_1_700"}
	// orders: 1 charges: 1 calls that charged: 1 receipts: 1
}
