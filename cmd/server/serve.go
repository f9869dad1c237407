package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemprom"
)

// readTimeout is the HTTP server's bound on reading a request, its body included;
// readHeaderTimeout its bound on the headers.
const (
	readTimeout       = time.Minute
	readHeaderTimeout = 10 * time.Second
)

func (m *Main) serve(ctx context.Context) (err error) {
	if err := m.openProbePool(ctx); err != nil {
		return err
	}
	m.registry = prometheus.NewRegistry()
	m.registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		idemprom.NewHealthCollector(m.probe, healthEvery, m.log))
	if m.receipts, err = m.startReceipts(ctx); err != nil {
		return err
	}
	handler, err := m.routes(ctx)
	if err != nil {
		return err
	}
	if m.receipts != nil {
		if err := m.runReceipts(ctx); err != nil {
			return err
		}
	}
	ln, err := net.Listen("tcp", m.Config.ListenAddr)
	if err != nil {
		return fmt.Errorf("LISTEN_ADDR=%s: %w", m.Config.ListenAddr, err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: readHeaderTimeout, ReadTimeout: readTimeout,
		IdleTimeout: 2 * time.Minute}

	var stopCleanup func()
	if m.Config.CleanupInterval > 0 {
		c, err := idem.StartCleaner(ctx, m.pool, idem.CleanerOptions{Interval: m.Config.CleanupInterval,
			BatchSize: m.Config.CleanupBatchSize, Duty: m.Config.CleanupDuty, SkipVacuum: !m.Config.CleanupVacuum,
			Logger: m.log, Metrics: idemprom.NewCleanupObserver(m.registry)})
		if err != nil {
			return err
		}
		stopCleanup = c.Stop
	}

	addr := ln.Addr().String()
	m.logReplication(ctx)
	m.log.Info("serving", "addr", addr, "version", Version)
	if note := newerNote(ctx, m.pool); note != "" {
		m.log.Warn(note)
	}
	if m.cluster != nil {
		m.log.Info(quickstartHint(m.Config.DataDir, addr, m.cluster.ConnString("postgres")))
	}
	m.Addr <- addr
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		if stopCleanup != nil {
			stopCleanup()
		}
		m.stopReceipts(context.Background())
		return err
	case <-ctx.Done():
	}
	m.log.Info("shutting down", "timeout", m.Config.ShutdownTimeout.String())
	sctx, cancel := context.WithTimeout(context.Background(), m.Config.ShutdownTimeout)
	defer cancel()
	// Stop accepting and let in-flight requests finish; lease work (which outlives its client)
	// is ended by the middleware's Shutdown when the timeout passes, so that it gives its
	// lease up for the client's retry instead of being cut off by the exit.
	work := make(chan error, 1)
	go func() { work <- m.idem.Shutdown(sctx) }()
	err = srv.Shutdown(sctx)
	if werr := <-work; werr != nil {
		m.log.Warn("keyed work still running at the shutdown timeout was ended", "error", werr)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		// The keyed work still running was ended (its requests are answered 503 shutting_down
		// now): their answers get a moment to go out, then the connections left are closed.
		// The documented stop, not a failed one.
		gctx, gcancel := context.WithTimeout(context.Background(), shutdownGrace)
		err = srv.Shutdown(gctx)
		gcancel()
		if err != nil {
			m.log.Warn("requests still running after the shutdown timeout were cut off", "error", err)
			err = srv.Close()
		}
	}
	if stopCleanup != nil {
		stopCleanup() // cancels a running pass and waits for it
	}
	m.stopReceipts(sctx)
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("shutdown: %w", err)
	}
	m.log.Info("stopped")
	return nil
}

// shutdownGrace is how long the requests whose keyed work the shutdown timeout ended have to
// send their answers before their connections are closed.
const shutdownGrace = 2 * time.Second

// logReplication says at start what a failover would do to the promise (idem_health's
// replication): the mode, and as a warning when an answered key could be lost on failover
// (a primary with standbys, none synchronous) or commits wait for a missing standby.
func (m *Main) logReplication(ctx context.Context) {
	h, err := idem.ReadHealth(ctx, m.probe)
	switch {
	case err != nil:
		m.log.Warn("could not read the database's replication (idem.idem_health())", "error", err)
	case h.ReplicationWarning != "":
		m.log.Warn("replication: "+h.ReplicationWarning, "replication", h.Replication, "standbys", h.Standbys)
	default:
		m.log.Info("replication", "replication", h.Replication, "standbys", h.Standbys)
	}
}

// quickstartHint is the line serve logs on a private cluster: the commands that create a
// principal and an account. The commands find the running cluster of their IDEM_DATA_DIR,
// wherever it listens, so a directory other than the default is named, quoted for a POSIX
// shell (a path with a space or a quote pasted as it is would name another directory).
func quickstartHint(dataDir, addr, postgresURL string) string {
	env := ""
	if dataDir != defaultConfig().DataDir {
		env = "IDEM_DATA_DIR=" + shellQuote(dataDir) + " "
	}
	return "quickstart: create a principal and keep its token with `TOKEN=$(" + env + "go run ./cmd/server principal create alice " +
		"| awk '/^token/ {print $2}')` (PostgreSQL at " + postgresURL + "), then: curl -s http://" + addr +
		"/v1/accounts -H \"Authorization: Bearer $TOKEN\" -H 'Content-Type: application/json' -d '{\"name\":\"main\",\"currency\":\"EUR\"}'"
}

// shellQuote is s as one word of a POSIX shell: as it is when it holds only characters no
// shell reads specially, else in single quotes, each single quote inside closing them, escaped
// with a backslash, and opening them again.
func shellQuote(s string) string {
	safe := s != ""
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("_./-+:,@%=", r)) {
			safe = false
			break
		}
	}
	if safe {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
