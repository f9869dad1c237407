package dbidem

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Watching the work's statements: every result a statement of a Tx (nested ones and
// batches included) gives is noted, so that a serialization failure or a deadlock makes
// RunTx run the unit again.

// nestedTx is a savepoint of a Tx: its statements are watched too.
type nestedTx struct {
	pgx.Tx
	owner *Tx
}

func (n *nestedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	nested, err := n.Tx.Begin(ctx)
	n.owner.note(err)
	if err != nil {
		return nil, err
	}
	return &nestedTx{Tx: nested, owner: n.owner}, nil
}

func (n *nestedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return execNoted(ctx, n.Tx, n.owner, sql, args)
}

func (n *nestedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return queryNoted(ctx, n.Tx, n.owner, sql, args)
}

func (n *nestedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	rows, err := n.Query(ctx, sql, args...)
	return &notedRow{rows: rows, err: err}
}

func (n *nestedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return &notedBatch{BatchResults: n.Tx.SendBatch(ctx, b), owner: n.owner}
}

func (n *nestedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	c, err := n.Tx.CopyFrom(ctx, table, columns, src)
	n.owner.note(err)
	return c, err
}

func execNoted(ctx context.Context, q pgx.Tx, owner *Tx, sql string, args []any) (pgconn.CommandTag, error) {
	tag, err := q.Exec(ctx, sql, args...)
	owner.note(err)
	if err == nil {
		err = owner.ended() // this statement ended the transaction
	}
	return tag, err
}

func queryNoted(ctx context.Context, q pgx.Tx, owner *Tx, sql string, args []any) (pgx.Rows, error) {
	rows, err := q.Query(ctx, sql, args...)
	owner.note(err)
	if err != nil {
		return rows, err
	}
	return &notedRows{Rows: rows, owner: owner}, nil
}

// notedRows notes the error that ends the rows.
type notedRows struct {
	pgx.Rows
	owner *Tx
}

func (r *notedRows) Err() error {
	err := r.Rows.Err()
	r.owner.note(err)
	return err
}

// Close closes the rows and notes the error that ended them: a handler that reads its rows
// to the end and never asks Err still has its serialization failure rerun.
func (r *notedRows) Close() {
	r.Rows.Close()
	r.owner.note(r.Rows.Err())
}

// notedRow behaves as pgx's Row: the first row, pgx.ErrNoRows when there is none.
type notedRow struct {
	rows pgx.Rows
	err  error
}

func (r *notedRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}

// notedBatch notes retryable errors from a batch's results.
type notedBatch struct {
	pgx.BatchResults
	owner *Tx
}

func (b *notedBatch) Exec() (pgconn.CommandTag, error) {
	tag, err := b.BatchResults.Exec()
	b.owner.note(err)
	return tag, err
}

func (b *notedBatch) Query() (pgx.Rows, error) {
	rows, err := b.BatchResults.Query()
	b.owner.note(err)
	if err != nil {
		return rows, err
	}
	return &notedRows{Rows: rows, owner: b.owner}, nil
}

func (b *notedBatch) QueryRow() pgx.Row {
	return &notedBatchRow{Row: b.BatchResults.QueryRow(), owner: b.owner}
}

func (b *notedBatch) Close() error {
	err := b.BatchResults.Close()
	b.owner.note(err)
	if err == nil {
		err = b.owner.ended() // a statement of the batch ended the transaction
	}
	return err
}

type notedBatchRow struct {
	pgx.Row
	owner *Tx
}

func (r *notedBatchRow) Scan(dest ...any) error {
	err := r.Row.Scan(dest...)
	r.owner.note(err)
	return err
}
