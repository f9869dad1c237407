package main

import (
	"encoding/json"
	"testing"
)

// TestOpenAPIVersionIsTheServers: /openapi.json describes this server's routes, so its
// info.version is the server's Version (it said 0.2.0 while describing routes added since).
func TestOpenAPIVersionIsTheServers(t *testing.T) {
	var doc struct {
		Info struct {
			Version string `json:"version"`
		} `json:"info"`
	}
	if err := json.Unmarshal(openAPI, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Info.Version != Version {
		t.Errorf("openapi.json info.version %q; the server is %q", doc.Info.Version, Version)
	}
}
