package main

import (
	"bytes"
	"context"
	"testing"
	"time"
)

func runMain(t *testing.T, args []string, env func(string) string) (string, string, error) {
	t.Helper()
	var out, errb bytes.Buffer
	m := NewMain(&out, &errb)
	if err := m.ParseFlags(args, env); err != nil {
		return out.String(), errb.String(), err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := m.Run(ctx)
	_ = m.Close()
	return out.String(), errb.String(), err
}
