package main

import (
	"context"
	"fmt"
	"math"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
)

// fingerprintPart runs internal/canon's BenchmarkCompute for every body shape at 64 KiB and at
// the default body limit (1 MiB), and BenchmarkStdlibDecode (encoding/json.Unmarshal of the
// same body into any) at 1 MiB. It reports every shape's time over the standard library's on
// the same body (the budget: at most reading the bytes once, on any machine), the worst
// shape's time at 1 MiB, and how much the cost per byte grows from 64 KiB to 1 MiB (flat:
// close to 1).
func fingerprintPart(ctx context.Context, b *bench) error {
	root, err := moduleRoot()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "test", "./internal/canon", "-run", "^$",
		"-bench", "^Benchmark(Compute|StdlibDecode)$/.*/(64|1024)KiB$", "-benchtime", "20x", "-count", "3")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("go test -bench BenchmarkCompute: %v\n%s", err, out)
	}
	line := regexp.MustCompile(`(?m)^Benchmark(Compute|StdlibDecode)/(\S+)/(64|1024)KiB-\d+\s+\d+\s+(\d+(?:\.\d+)?) ns/op\s+(\d+(?:\.\d+)?) MB/s`)
	ns := map[string][]float64{}   // "shape/size" -> ns/op of each count
	perB := map[string][]float64{} // "shape/size" -> ns per byte
	std := map[string][]float64{}  // shape -> the standard library's ns/op at 1 MiB
	for _, m := range line.FindAllStringSubmatch(string(out), -1) {
		v, _ := strconv.ParseFloat(m[4], 64)
		if m[1] == "StdlibDecode" {
			if m[3] == "1024" {
				std[m[2]] = append(std[m[2]], v)
			}
			continue
		}
		k := m[2] + "/" + m[3]
		mbs, _ := strconv.ParseFloat(m[5], 64)
		ns[k] = append(ns[k], v)
		perB[k] = append(perB[k], 1000/mbs)
	}
	if len(ns) == 0 {
		return fmt.Errorf("no benchmark lines in:\n%s", out)
	}
	var shapes []string
	for k := range ns {
		if shape, size, _ := cut(k); size == "1024" {
			shapes = append(shapes, shape)
		}
	}
	sort.Strings(shapes)
	fmt.Printf("%-20s %12s %14s %14s %14s %8s\n", "shape", "1 MiB ms", "ns/B 64 KiB", "ns/B 1 MiB", "std ms", "ratio")
	worst, worstMs, flat, flatShape := "", 0.0, 0.0, ""
	worstRatio, ratioShape := 0.0, ""
	for _, s := range shapes {
		ms := median(ns[s+"/1024"]) / 1e6
		small, large := median(perB[s+"/64"]), median(perB[s+"/1024"])
		stdMs := median(std[s]) / 1e6
		fmt.Printf("%-20s %12.1f %14.1f %14.1f %14.1f %8.2f\n", s, ms, small, large, stdMs, ms/stdMs)
		if ms > worstMs {
			worst, worstMs = s, ms
		}
		if large/small > flat {
			flat, flatShape = large/small, s
		}
		if r := ms / stdMs; r > worstRatio || math.IsNaN(r) {
			worstRatio, ratioShape = r, s
		}
	}
	b.ratio("fingerprint: worst shape / encoding/json decode of the same 1 MiB body ("+ratioShape+")", worstRatio, "<=", 1.0)
	b.check("fingerprint: worst body shape at the 1 MiB limit, ms ("+worst+")", fmt.Sprintf("%.1f", worstMs), worstMs, "", 0, "%.0f")
	b.ratio("fingerprint: cost per byte 1 MiB / 64 KiB, worst shape ("+flatShape+")", flat, "", 0)
	return nil
}

// cut splits "shape/size".
func cut(k string) (shape, size string, ok bool) {
	i := len(k) - 1
	for i >= 0 && k[i] != '/' {
		i--
	}
	if i < 0 {
		return k, "", false
	}
	return k[:i], k[i+1:], true
}
