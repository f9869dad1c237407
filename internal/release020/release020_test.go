package release020

import (
	"context"
	"strings"
	"testing"
)

// TestBinary: the server built from Commit is release 0.2.0's and says so.
func TestBinary(t *testing.T) {
	out, err := Run(context.Background(), "", nil, "version")
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(out) != Version {
		t.Fatalf("server version of commit %s: %q, want %q", Commit, out, Version)
	}
}
