package idem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/internal/pgtest"
)

// Extend with a lease of 0 said "p_attempt and p_lease must not be NULL" (Go's zero goes as
// the functions' NULL default); it says that the lease must be positive, and changes nothing.
func TestExtendZeroLeaseSaysSo(t *testing.T) {
	t.Parallel()
	pool, _ := pgtest.NewPool(t, 2)
	ctx := context.Background()
	c := llClaim("ext0", time.Minute)
	d := llLease(t, pool, c)
	_, err := idem.Extend(ctx, pool, c.Principal, c.Key, d.Attempt, 0)
	if !errors.Is(err, idem.ErrInvalidArgument) || !strings.Contains(err.Error(), "must be positive") {
		t.Errorf("Extend with a lease of 0: %v; want ErrInvalidArgument saying the lease must be positive", err)
	}
	if _, err := idem.Extend(ctx, pool, c.Principal, c.Key, d.Attempt, time.Minute); err != nil {
		t.Errorf("Extend after it: %v", err)
	}
}
