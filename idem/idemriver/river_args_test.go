package idemriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pgidem/pgidem/idem"
	"github.com/pgidem/pgidem/idem/idemriver"
)

type deepArgs struct {
	Payload json.RawMessage `json:"payload"`
}

func (deepArgs) Kind() string { return "deep" }

// TestDeepArgs: a job whose args nest deeply (a webhook's payload as it came), inserted by
// River (PostgreSQL's jsonb took it): does Work run it, once?
func TestDeepArgs(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	for _, depth := range []int{1000, 5000} {
		payload := strings.Repeat("[", depth) + strings.Repeat("]", depth)
		res, err := client.Insert(ctx, deepArgs{Payload: json.RawMessage(payload)}, nil)
		if err != nil {
			t.Logf("depth %d: River's insert refused: %v", depth, err)
			continue
		}
		runs := 0
		for range 2 {
			err = idemriver.Work(ctx, res.Job, idemriver.Options{DB: pool, Lease: time.Second},
				func(context.Context, idem.LeaseClaim) error { runs++; return nil })
			if err != nil || runs != 1 {
				t.Errorf("depth %d: Work %v, runs %d; want run once", depth, err, runs)
			}
		}
	}
}

type amountArgs struct {
	Order  int64           `json:"order"`
	Amount json.RawMessage `json:"amount"`
}

func (amountArgs) Kind() string { return "amount" }

// TestKeyByOrderNumbers: a Key by order: two jobs of the order whose amounts differ only past
// float64's precision, or are huge, are other arguments (a cancel with ErrMismatch), never a
// replay of the first.
func TestKeyByOrderNumbers(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	client := newClient(t, pool, nil)
	opts := idemriver.Options{DB: pool, Lease: time.Second, Key: func(j *rivertype.JobRow) string {
		var a amountArgs
		_ = json.Unmarshal(j.EncodedArgs, &a)
		return "order/" + strconv.FormatInt(a.Order, 10)
	}}
	for i, pair := range [][2]string{{"9007199254740993", "9007199254740992"}, {"1e400", "1e401"}, {"0.1", "0.10000000000000001"}} {
		runs := 0
		for j, amt := range pair {
			res, err := client.Insert(ctx, amountArgs{Order: int64(i), Amount: json.RawMessage(amt)}, nil)
			if err != nil {
				t.Fatal(err)
			}
			err = idemriver.Work(ctx, res.Job, opts, func(context.Context, idem.LeaseClaim) error { runs++; return nil })
			var cancel *river.JobCancelError
			if j == 1 && !(errors.As(err, &cancel) && errors.Is(err, idem.ErrMismatch)) {
				t.Errorf("amounts %s then %s (args %s): second job %v, runs %d; want ErrMismatch", pair[0], pair[1], res.Job.EncodedArgs, err, runs)
			}
		}
	}
}
