package idem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// TestCheckSchemaServesCallKilledIsUnavailable: CheckSchema's doc (idem/schema.go): "the
// database's error when it could not be asked (IsUnavailable tells)". Any *pgconn.PgError of
// the idem_serves_version call was read as "it raised: the database answered, and not yes". A
// backend terminated while that call runs (57P01 admin_shutdown: a restart, a failover, an operator's pg_terminate_backend during the
// rolling upgrade) is a database that could not be asked, not a newer release that refuses
// this code: CheckSchema had turned it into a *SchemaError wrapping ErrSchemaNewer ("upgrade this
// module"), and idem.New refuses to start on it.
func TestCheckSchemaServesCallKilledIsUnavailable(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	owner, url := pgtest.NewPool(t, 4)
	app := newPool(t, pgtest.LoginRole(t, url, "idem_app"))
	want := idem.SchemaVersion()
	// A newer release that serves this one, slowly (its function answers after a while).
	servesNext(t, owner, want+1, want+1, `PERFORM pg_sleep(3); RETURN p_version BETWEEN 5 AND `+fmt.Sprint(want+1)+`;`)
	done := make(chan error, 1)
	go func() { done <- idem.CheckSchema(ctx, app) }()
	pgtest.WaitFor(t, owner, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE '%idem_serves_version%'`)
	pgtest.Exec(t, owner, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE '%idem_serves_version%'`)
	err := <-done
	var se *idem.SchemaError
	if errors.As(err, &se) || errors.Is(err, idem.ErrSchemaNewer) || !idem.IsUnavailable(err) {
		t.Errorf("CheckSchema whose idem_serves_version call was cut off by a terminated backend: %v (SchemaError %v, ErrSchemaNewer %v, IsUnavailable %v); "+
			"want the database's error, IsUnavailable true", err, errors.As(err, &se), errors.Is(err, idem.ErrSchemaNewer), idem.IsUnavailable(err))
	}
}
