package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// TestShop: an order, its retry (the same answer, replayed), another order under the same key
// (422), and one order in the table. It needs a PostgreSQL: TEST_DATABASE_URL, a database it
// may create schema idem and a table in (the repository's tests/examples_test.go runs it so).
func TestShop(t *testing.T) {
	url := os.Getenv("TEST_DATABASE_URL")
	if url == "" {
		t.Fatal("set TEST_DATABASE_URL to a PostgreSQL database (the repository's make test does)")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	handler, err := newShop(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(handler)
	defer srv.Close()
	post := func(body string) *http.Response {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("X-Customer", "c1")
		req.Header.Set("Idempotency-Key", "order-1")
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res
	}
	if res := post(`{"sku":"a1","qty":2}`); res.StatusCode != 201 {
		t.Fatalf("the order: %d", res.StatusCode)
	}
	if res := post(`{"sku":"a1","qty":2}`); res.StatusCode != 201 || res.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("its retry: %d %v", res.StatusCode, res.Header)
	}
	if res := post(`{"sku":"a1","qty":3}`); res.StatusCode != 422 {
		t.Fatalf("another order under the key: %d", res.StatusCode)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d orders, %v; want 1", n, err)
	}
}
