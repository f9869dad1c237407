package idemriver_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
	"github.com/pgidem/pgidem/idem/idemtest"
)

// OrderReceipt is the job: e-mail the receipt of an order.
type OrderReceipt struct {
	Order int64 `json:"order"`
}

func (OrderReceipt) Kind() string { return "order_receipt" }

// mailer stands for an e-mail provider that deduplicates by the idempotency key it is given.
type mailer struct {
	mu   sync.Mutex
	sent map[string]int64
}

func (m *mailer) Send(_ context.Context, idempotencyKey string, order int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, done := m.sent[idempotencyKey]; !done {
		m.sent[idempotencyKey] = order
	}
	return nil
}

// ReceiptWorker sends the receipt under the job's lease: River's retries, and a worker that
// died in the middle, reach the mailer under one key.
type ReceiptWorker struct {
	river.WorkerDefaults[OrderReceipt]
	DB     *pgxpool.Pool
	Mailer *mailer
}

func (w *ReceiptWorker) Work(ctx context.Context, job *river.Job[OrderReceipt]) error {
	return idemriver.Work(ctx, job.JobRow, idemriver.Options{DB: w.DB}, func(ctx context.Context, claim idem.LeaseClaim) error {
		return w.Mailer.Send(ctx, claim.ProviderKey, job.Args.Order)
	})
}

// An order route that enqueues the order's receipt in the order's own transaction, and a
// River worker that sends it: the client's retry of the order is a replay that enqueues
// nothing, and the receipt is sent once.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, idemtest.ExampleDB()) // schema idem installed
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := migrateRiver(ctx, pool); err != nil { // rivermigrate, as the database's owner
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, sku text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	m := &mailer{sent: map[string]int64{}}
	workers := river.NewWorkers()
	river.AddWorker(workers, &ReceiptWorker{DB: pool, Mailer: m})
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 10}},
		Workers: workers,
		Logger:  quiet,
	})
	if err != nil {
		log.Fatal(err)
	}
	completed, stop := client.Subscribe(river.EventKindJobCompleted)
	defer stop()
	if err := client.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer func() { _ = client.Stop(ctx) }()

	idm, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		log.Fatal(err)
	}
	createOrder := func(w http.ResponseWriter, r *http.Request) {
		var o struct {
			SKU string `json:"sku"`
		}
		if !idem.DecodeJSON(w, r, &o) {
			return
		}
		var id int64
		err := idem.TxFrom(r.Context()).QueryRow(r.Context(), `INSERT INTO orders (sku) VALUES ($1) RETURNING id`, o.SKU).Scan(&id)
		if err == nil {
			_, err = idemriver.Insert(r.Context(), client, OrderReceipt{Order: id}, nil) // commits with the order and the key
		}
		if err != nil {
			http.Error(w, "try again", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", idm.Route(idem.Route{Required: true})(http.HandlerFunc(createOrder)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 2 { // the client retries: the second is a replay
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"sku":"a1"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "order-1")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		res.Body.Close()
		fmt.Println(res.StatusCode, res.Header.Get("Idempotent-Replayed") == "true")
	}
	select {
	case ev := <-completed:
		fmt.Println("completed:", ev.Job.Kind)
	case <-time.After(30 * time.Second):
		log.Fatal("the receipt job did not complete")
	}
	var jobs int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM river_job`).Scan(&jobs); err != nil {
		log.Fatal(err)
	}
	fmt.Println("jobs:", jobs, "receipts sent:", len(m.sent))
	// Output:
	// 201 false
	// 201 true
	// completed: order_receipt
	// jobs: 1 receipts sent: 1
}
