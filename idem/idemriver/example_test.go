package idemriver_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
	"github.com/pgidem/pgidem/idem/idemtest"
)

// OrderCharge is the job that charges an order's card.
type OrderCharge struct {
	Order  int64 `json:"order"`
	Amount int64 `json:"amount"`
}

func (OrderCharge) Kind() string { return "order_charge" }

// OrderReceipt is the job that e-mails an order's receipt.
type OrderReceipt struct {
	Order int64 `json:"order"`
}

func (OrderReceipt) Kind() string { return "order_receipt" }

// Provider stands for an outside service (payments, e-mail) that deduplicates by the
// idempotency key it is given, as Stripe does: a repeated key has no second effect.
type Provider struct {
	mu      sync.Mutex
	effects map[string]string // idempotency key -> reference
}

func (p *Provider) Call(idempotencyKey string) (ref string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.effects == nil {
		p.effects = map[string]string{}
	}
	if _, ok := p.effects[idempotencyKey]; !ok {
		p.effects[idempotencyKey] = fmt.Sprintf("ref-%d", len(p.effects)+1)
	}
	return p.effects[idempotencyKey]
}

// Effects is how many calls had an effect: one per idempotency key.
func (p *Provider) Effects() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.effects)
}

// ChargeWorker charges the card under the job's lease, with the claim's provider key, then
// records the charge and enqueues the receipt in one transaction that only the first
// recording commits with an effect.
type ChargeWorker struct {
	river.WorkerDefaults[OrderCharge]
	DB       *pgxpool.Pool
	Payments *Provider
}

func (w *ChargeWorker) Work(ctx context.Context, job *river.Job[OrderCharge]) error {
	return idemriver.Work(ctx, job.JobRow, idemriver.Options{DB: w.DB}, func(ctx context.Context, claim idem.LeaseClaim) error {
		ref := w.Payments.Call(claim.ProviderKey) // every run of this job: one charge
		tx, err := w.DB.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		tag, err := tx.Exec(ctx, `UPDATE orders SET charge_ref = $1 WHERE id = $2 AND charge_ref IS NULL`, ref, job.Args.Order)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 1 { // the first recording of the charge enqueues the receipt
			client := river.ClientFromContext[pgx.Tx](ctx)
			if _, err := client.InsertTx(ctx, tx, OrderReceipt{Order: job.Args.Order}, nil); err != nil {
				return err
			}
		}
		return tx.Commit(ctx)
	})
}

// ReceiptWorker e-mails the receipt under the job's lease, with the claim's provider key.
type ReceiptWorker struct {
	river.WorkerDefaults[OrderReceipt]
	DB   *pgxpool.Pool
	Mail *Provider
}

func (w *ReceiptWorker) Work(ctx context.Context, job *river.Job[OrderReceipt]) error {
	return idemriver.Work(ctx, job.JobRow, idemriver.Options{DB: w.DB}, func(ctx context.Context, claim idem.LeaseClaim) error {
		w.Mail.Call(claim.ProviderKey) // every run of this job: one e-mail
		return nil
	})
}

// The order, its charge and its receipt. POST /orders creates the order and enqueues its
// charge in the request's transaction: the order, the job and the key commit together, and
// the client's retry is a replay that enqueues nothing. The charge and the receipt run after
// the answer, each once in effect.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, idemtest.ExampleDB()) // a database with schema idem installed
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	quiet := slog.New(slog.DiscardHandler)
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: quiet})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil { // River's tables
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, sku text NOT NULL,
		amount bigint NOT NULL, charge_ref text)`); err != nil {
		log.Fatal(err)
	}

	payments, mail := &Provider{}, &Provider{}
	workers := river.NewWorkers()
	river.AddWorker(workers, &ChargeWorker{DB: pool, Payments: payments})
	river.AddWorker(workers, &ReceiptWorker{DB: pool, Mail: mail})
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

	m, err := idem.New(ctx, idem.Options{DB: pool, Principal: func(*http.Request) (string, bool) { return "alice", true }})
	if err != nil {
		log.Fatal(err)
	}
	createOrder := func(w http.ResponseWriter, r *http.Request) {
		var o struct {
			SKU    string `json:"sku"`
			Amount int64  `json:"amount"`
		}
		if !idem.DecodeJSON(w, r, &o) {
			return
		}
		var id int64
		err := idem.TxFrom(r.Context()).QueryRow(r.Context(),
			`INSERT INTO orders (sku, amount) VALUES ($1, $2) RETURNING id`, o.SKU, o.Amount).Scan(&id)
		if err == nil { // the charge's job commits with the order and the key
			_, err = idemriver.Insert(r.Context(), client, OrderCharge{Order: id, Amount: o.Amount}, nil)
		}
		if err != nil {
			http.Error(w, "try again", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"status":"pending"}`, id)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", m.Route(idem.Route{Required: true})(http.HandlerFunc(createOrder)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 2 { // the client retries (its first answer was lost): a replay
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"sku":"a1","amount":2500}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", "order-1")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		res.Body.Close()
		fmt.Println(res.StatusCode, "replayed:", res.Header.Get("Idempotent-Replayed") == "true")
	}
	done := map[string]bool{}
	for len(done) < 2 { // the charge, and the receipt it enqueued
		select {
		case ev := <-completed:
			done[ev.Job.Kind] = true
		case <-time.After(30 * time.Second):
			log.Fatal("a job did not complete")
		}
	}
	fmt.Println("completed:", done)
	var jobs int
	var ref string
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM river_job), (SELECT charge_ref FROM orders)`).Scan(&jobs, &ref); err != nil {
		log.Fatal(err)
	}
	fmt.Println("jobs:", jobs, "charges:", payments.Effects(), "e-mails:", mail.Effects(), "order charged:", ref)
	// Output:
	// 201 replayed: false
	// 201 replayed: true
	// completed: map[order_charge:true order_receipt:true]
	// jobs: 2 charges: 1 e-mails: 1 order charged: ref-1
}
