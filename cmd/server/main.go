// Command server is the reference server of idem: a small ledger API (accounts, deposits,
// transfers, API tokens) whose POST routes are made idempotent by internal/http, with
// in-process cleanup of expired keys, Prometheus metrics and an OpenAPI document.
//
//	server [serve]                 serve HTTP on LISTEN_ADDR (default)
//	server migrate                 apply the migrations and install the SQL API, then exit
//	server cleanup                 delete expired idempotency keys (one full pass), then exit
//	server principal create NAME   create a principal; print its id and a bearer token once
//	server keys [...]              the keys' summary, one key's story, a stuck lease's release
//	server version                 print the version
//
// Without DATABASE_URL the server creates, starts and reuses a private PostgreSQL cluster
// under .data/ and migrates it (the `make run` default). docs/operations.md lists every
// environment variable.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"
)

func main() {
	// One channel from the start, with room for both signals: a second one that came before
	// the first was handled is not lost (D179).
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	m := NewMain(os.Stdout, os.Stderr)
	// The first signal starts the stop; a second one ends the process at once, after stopping
	// the private cluster if this process started it (pg_ctl runs it in a session of its own,
	// which no signal of the terminal reaches).
	go func() {
		first := <-sigs
		at := time.Now()
		stop()
		for {
			sig := <-sigs
			if sig == first && time.Since(at) < sameStop {
				// One stop delivered twice: a kill of the process group reaches this process
				// and the one that runs it, which passes it on (make, timeout). Not a second
				// request to stop at once (D256).
				continue
			}
			fmt.Fprintln(os.Stderr, "server: a second signal: stopping at once")
			m.Abort()
			os.Exit(1)
		}
	}()
	if err := m.ParseFlags(os.Args[1:], os.Getenv); err != nil {
		fmt.Fprintln(os.Stderr, "server:", err)
		os.Exit(2)
	}
	if m.Command == "serve" {
		// The log's reader may go away (`server serve | head`, a log shipper or journald
		// that restarts): the server keeps serving, and the lines it writes meanwhile are
		// lost, rather than the process dying of SIGPIPE with its requests in flight (D262).
		// The other commands end as a Unix command does when its output is closed.
		signal.Ignore(syscall.SIGPIPE)
	}
	err := m.Run(ctx)
	if cerr := m.Close(); err == nil {
		err = cerr
	}
	if code := exitCode(m.Command, ctx.Err() != nil, err); code != 0 {
		if errors.Is(err, context.Canceled) {
			err = fmt.Errorf("%s interrupted by a signal before it finished: %w", m.Command, err)
		}
		fmt.Fprintln(os.Stderr, "server:", err)
		os.Exit(code)
	}
}

// sameStop is how long after the first signal the same signal again is taken for the same
// stop, delivered twice, rather than for a second signal.
const sameStop = 200 * time.Millisecond

// exitCode is the process's exit status for a command that ended with err, signaled when a
// signal ended its context: 0 when it did its work; 1 when it failed, or when a signal stopped
// it before it finished (a cron job or a deploy step must not take an interrupted migrate or
// cleanup for a done one). serve stops on a signal by design: its graceful stop is a success.
func exitCode(command string, signaled bool, err error) int {
	switch {
	case err == nil:
		return 0
	case command == "serve" && signaled && errors.Is(err, context.Canceled):
		return 0 // stopped while starting
	default:
		return 1
	}
}

// NewMain returns a Main that writes its output to stdout and its logs to stderr.
func NewMain(stdout, stderr io.Writer) *Main {
	return &Main{stdout: stdout, stderr: stderr}
}
