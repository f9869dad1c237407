package main

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestReviewOps3PoolSizeInDatabaseURL: docs/operations.md: DATABASE_URL is the "PostgreSQL connection
// string (URL or key/value); pgx options such as default_query_exec_mode=exec go here", and
// DATABASE_POOL_SIZE is "the most connections this process's requests and cleanup use". pgx's own pool options in
// DATABASE_URL (pool_max_conns, which pgx documents and operators copy from other pgx
// services) conflict with DATABASE_POOL_SIZE: the start must refuse the conflict or honour
// it, not silently replace pool_max_conns=10 by the default (4 on this machine), as it did.
// It is refused now (D171).
func TestReviewOps3PoolSizeInDatabaseURL(t *testing.T) {
	t.Parallel()
	base := startServer(t, nil)
	url := base.db + " pool_max_conns=10"
	if strings.Contains(base.db, "://") {
		url = base.db + "&pool_max_conns=10"
		if !strings.Contains(base.db, "?") {
			url = base.db + "?pool_max_conns=10"
		}
	}
	m := NewMain(io.Discard, io.Discard)
	if err := m.ParseFlags(nil, serverEnv(url, nil)); err != nil {
		t.Logf("refused at start: %v", err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	select {
	case <-m.Addr:
	case err := <-done:
		cancel()
		t.Logf("refused: %v", err)
		return
	case <-time.After(60 * time.Second):
		t.Fatal("no start")
	}
	got := m.pool.Config().MaxConns
	cancel()
	<-done
	_ = m.Close()
	if got != 10 {
		t.Errorf("DATABASE_URL has pool_max_conns=10, DATABASE_POOL_SIZE unset: the server started with a pool of %d, silently; want 10 or a start error naming the conflict", got)
	}
	_ = pgtest.Count
}
