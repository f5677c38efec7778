// rallypoint console: the little JavaScript the server-rendered pages use.
// - the run tree: a node's children are fetched when it is expanded, a page at a time;
// - live parts: the page's server-sent event stream (/stream) says when something
//   changed ("changed") or ticks each second ("stats"); the parts marked for it are
//   fetched again (?part=NAME), at most once a second -- no polling loop;
// - the Live page: events appended as they arrive (inserted as text), and two charts
//   drawn from the "stats" samples;
// - deadlines counted down.
// No library, no build step. Every value from the server that is not server-rendered
// HTML is inserted with textContent.
(function () {
  "use strict";
  var MIN_INTERVAL_MS = 1000;
  var MAX_EVENT_ROWS = 300;
  var body = document.body;

  function setLive(on) {
    body.dataset.live = on ? "on" : "off";
    var el = document.getElementById("live-status");
    if (el) { el.className = on ? "on" : "off"; el.title = on ? "live updates on" : "reconnecting…"; }
  }

  function withPart(href, part) {
    var u = new URL(href, window.location.origin);
    u.searchParams.set("part", part);
    return u.pathname + u.search;
  }

  function fetchHtml(href) {
    return fetch(href, {credentials: "same-origin", cache: "no-store", headers: {"X-Console-Fragment": "1"}})
      .then(function (r) {
        if (r.status === 401) { window.location.reload(); throw new Error("signed out"); }
        if (!r.ok) { throw new Error("HTTP " + r.status); }
        return r.text();
      });
  }

  // ------------------------------------------------------------------ live parts
  var state = {};  // refresh kind -> {busy, pending, last}
  function schedule(kind) {
    var parts = document.querySelectorAll('[data-refresh="' + kind + '"]');
    if (!parts.length) { return; }
    var s = state[kind] || (state[kind] = {busy: false, pending: false, last: 0, timer: null});
    if (s.busy || s.timer) { s.pending = true; return; }
    var wait = s.last + MIN_INTERVAL_MS - Date.now();
    if (wait > 0) {
      s.timer = setTimeout(function () { s.timer = null; schedule(kind); }, wait);
      return;
    }
    s.busy = true; s.pending = false; s.last = Date.now();
    var jobs = Array.prototype.map.call(parts, function (part) {
      return fetchHtml(part.dataset.src).then(function (html) { part.innerHTML = html; drawTrends(part); });
    });
    Promise.all(jobs).catch(function () {}).then(function () {
      s.busy = false;
      countdown();
      body.dataset.refreshed = String((parseInt(body.dataset.refreshed || "0", 10) + 1));
      if (s.pending) { schedule(kind); }
    });
  }

  // ------------------------------------------------------------------ the tree
  document.addEventListener("click", function (ev) {
    var t = ev.target;
    if (!(t instanceof Element)) { return; }
    var toggle = t.closest("button.toggle");
    if (toggle) {
      var li = toggle.closest("li");
      var ul = li.querySelector(":scope > ul.tree");
      var open = toggle.getAttribute("aria-expanded") === "true";
      if (open) {
        ul.hidden = true; toggle.setAttribute("aria-expanded", "false"); toggle.textContent = "▸";
        li.classList.remove("open");
        return;
      }
      if (toggle.dataset.loaded) {
        ul.hidden = false; toggle.setAttribute("aria-expanded", "true"); toggle.textContent = "▾";
        li.classList.add("open");
        return;
      }
      toggle.disabled = true;
      fetchHtml(withPart(toggle.dataset.children, "children")).then(function (html) {
        ul.innerHTML = html; ul.hidden = false; toggle.dataset.loaded = "1";
        toggle.setAttribute("aria-expanded", "true"); toggle.textContent = "▾"; li.classList.add("open");
        countdown();
      }).catch(function () {}).then(function () { toggle.disabled = false; });
      return;
    }
    var more = t.closest("button.more");
    if (more) {
      more.disabled = true;
      fetchHtml(withPart(more.dataset.more, "children")).then(function (html) {
        var row = more.closest("li");
        row.insertAdjacentHTML("beforebegin", html);
        row.remove();
      }).catch(function () { more.disabled = false; });
      return;
    }
    if (t.id === "pause") {
      paused = !paused;
      t.textContent = paused ? "Resume" : "Pause";
    }
  });

  // ------------------------------------------------------------------ deadlines
  function fmt(sec) {
    sec = Math.floor(Math.abs(sec));
    if (sec < 60) { return sec + "s"; }
    if (sec < 3600) { return Math.floor(sec / 60) + "m " + String(sec % 60).padStart(2, "0") + "s"; }
    if (sec < 86400) { return Math.floor(sec / 3600) + "h " + String(Math.floor(sec % 3600 / 60)).padStart(2, "0") + "m"; }
    return Math.floor(sec / 86400) + "d " + String(Math.floor(sec % 86400 / 3600)).padStart(2, "0") + "h";
  }
  function countdown() {
    var now = Date.now();
    document.querySelectorAll("[data-deadline]").forEach(function (el) {
      var rest = (Date.parse(el.dataset.deadline) - now) / 1000;
      el.textContent = rest > 0 ? "in " + fmt(rest) : "passed " + fmt(rest) + " ago";
      el.classList.toggle("passed", rest <= 0);
    });
  }
  setInterval(countdown, 1000);

  // ------------------------------------------------------------------ the Live page
  var paused = false;
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    if (cls) {
      var span = document.createElement("span");
      span.className = cls; span.textContent = text; td.appendChild(span);
    } else { td.textContent = text; }
    tr.appendChild(td);
    return td;
  }
  function addEvents(msg) {
    var tbody = document.getElementById("events");
    if (!tbody || paused) { return; }
    var frag = document.createDocumentFragment();
    (msg.events || []).forEach(function (e) {
      var tr = document.createElement("tr");
      tr.dataset.type = e.type;
      if (e.run) { tr.dataset.run = e.run; }
      // on a cluster each shard numbers its own events: "shard:seq"
      var id = (e.shard !== undefined && e.shard !== null ? e.shard + ":" : "") + e.seq;
      tr.dataset.id = id;
      cell(tr, id);
      cell(tr, String(e.at).slice(0, 19).replace("T", " "), "when");
      cell(tr, e.type, "badge s-" + e.type.replace(/[^a-z0-9_-]/gi, "-"));
      cell(tr, e.kind + ":" + e.id);
      var td = cell(tr, "");
      if (e.run) {
        var link = document.createElement("a");
        link.href = "/runs/" + encodeURIComponent(e.run); link.textContent = e.run; td.appendChild(link);
      } else { td.textContent = "—"; }
      var data = e.data ? Object.keys(e.data).filter(function (k) { return e.data[k] !== null; })
        .map(function (k) { return k + "=" + (typeof e.data[k] === "object" ? JSON.stringify(e.data[k]) : e.data[k]); })
        .join(", ") : "";
      cell(tr, data);
      frag.insertBefore(tr, frag.firstChild);
    });
    tbody.insertBefore(frag, tbody.firstChild);
    while (tbody.rows.length > MAX_EVENT_ROWS) { tbody.deleteRow(tbody.rows.length - 1); }
  }

  var samples = [];
  var SVG = "http://www.w3.org/2000/svg";
  function draw(id, series) {
    var svg = document.getElementById(id);
    if (!svg) { return; }
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    var max = 1;
    series.forEach(function (s) {
      samples.forEach(function (x) { var v = x[s.key]; if (typeof v === "number" && v > max) { max = v; } });
    });
    var n = 120, w = 600, hgt = 120;
    series.forEach(function (s) {
      var pts = [];
      samples.forEach(function (x, i) {
        var v = x[s.key];
        if (typeof v !== "number") { return; }
        var px = w - (samples.length - 1 - i) * (w / (n - 1));
        pts.push(px.toFixed(1) + "," + (hgt - 4 - v / max * (hgt - 8)).toFixed(1));
      });
      var line = document.createElementNS(SVG, "polyline");
      line.setAttribute("points", pts.join(" "));
      line.setAttribute("class", "line " + s.cls);
      svg.appendChild(line);
    });
    var label = document.createElementNS(SVG, "text");
    label.setAttribute("x", "4"); label.setAttribute("y", "12"); label.setAttribute("class", "axis");
    label.textContent = "max " + (Math.round(max * 100) / 100);
    svg.appendChild(label);
  }
  function onStats(x) {
    samples.push(x);
    if (samples.length > 120) { samples.shift(); }
    draw("chart-rate", [{key: "done_per_s", cls: "done"}, {key: "rps", cls: "rps"}, {key: "events_per_s", cls: "evs"}]);
    draw("chart-latency", [{key: "p50_ms", cls: "p50"}, {key: "p99_ms", cls: "p99"}]);
    var r = document.getElementById("rate-now");
    if (r) {
      r.textContent = "now: " + x.done_per_s + " tasks done/s" + (x.rps !== undefined ? ", " + x.rps + " requests/s" : "")
        + ", " + x.events_per_s + " events/s";
    }
    var l = document.getElementById("latency-now");
    if (l && x.p50_ms !== undefined) {
      l.textContent = "now: p50 " + (x.p50_ms === null ? "—" : "≤ " + x.p50_ms + " ms")
        + ", p99 " + (x.p99_ms === null ? "—" : "≤ " + x.p99_ms + " ms");
    }
    body.dataset.stats = String(samples.length);
    if (samples.length >= 3) { body.dataset.charted = "yes"; }
  }

  // ------------------------------------------------------------------ queue trends (uPlot)
  // A [data-trend] figure holds the last hour's samples as JSON columns (t, depth,
  // in_flight, done_per_s, p50_ms, p99_ms); uPlot (vendored: static/vendor/) is loaded
  // on the first such figure and draws three charts; the table beside them stays (for
  // a page without JavaScript it is the only view).
  var uplotLoading = null;
  function loadUplot() {
    if (window.uPlot) { return Promise.resolve(); }
    if (uplotLoading) { return uplotLoading; }
    var css = document.createElement("link");
    css.rel = "stylesheet"; css.href = "/static/vendor/uPlot.min.css";
    document.head.appendChild(css);
    uplotLoading = new Promise(function (resolve, reject) {
      var s = document.createElement("script");
      s.src = "/static/vendor/uPlot.iife.min.js"; s.onload = resolve; s.onerror = reject;
      document.head.appendChild(s);
    });
    return uplotLoading;
  }
  var CHARTS = [
    {title: "Depth and in flight (tasks)", series: [["depth", "depth", "#2457c5"], ["in_flight", "in flight", "#9a6700"]]},
    {title: "Completions per second", series: [["done_per_s", "done / s", "#1f7a3d"]]},
    {title: "Lifecycle latency (ms, submission to end)", series: [["p50_ms", "p50", "#2457c5"], ["p99_ms", "p99", "#b42318"]]}
  ];
  function drawTrends(root) {
    var figs = (root || document).querySelectorAll("[data-trend]");
    if (!figs.length) { return; }
    loadUplot().then(function () {
      figs.forEach(function (fig) {
        var cols = JSON.parse(fig.dataset.trend);
        var box = fig.querySelector(".trend-charts");
        while (box.firstChild) { box.removeChild(box.firstChild); }
        var width = Math.max(320, Math.min(1300, box.clientWidth || 900));
        CHARTS.forEach(function (c) {
          var el = document.createElement("div");
          el.className = "trend-chart";
          box.appendChild(el);
          var series = [{}].concat(c.series.map(function (s) { return {label: s[1], stroke: s[2], width: 2, spanGaps: false}; }));
          var data = [cols.t].concat(c.series.map(function (s) { return cols[s[0]]; }));
          new window.uPlot({title: c.title, width: width, height: 170, series: series,
                            scales: {x: {time: true}}, axes: [{}, {size: 56}]}, data, el);
        });
        var table = fig.querySelector("details");
        if (table) { table.open = false; }
        fig.dataset.drawn = "yes";
      });
      body.dataset.trend = "drawn";
    }).catch(function () { body.dataset.trend = "failed"; });
  }

  // ------------------------------------------------------------------ the stream
  function connect() {
    var src = body.dataset.stream;
    if (!src || !window.EventSource) { return; }
    var es = new EventSource(src);
    var readyOnce = false;
    es.addEventListener("ready", function () {
      if (!body.dataset.liveAt) { body.dataset.liveAt = String(Math.round(performance.now())); }
      setLive(true);
      if (readyOnce) { schedule("changed"); }  // reconnected: what changed meanwhile
      readyOnce = true;
    });
    es.addEventListener("changed", function () { schedule("changed"); });
    es.addEventListener("stats", function (e) { schedule("tick"); onStats(JSON.parse(e.data)); });
    es.addEventListener("events", function (e) { addEvents(JSON.parse(e.data)); });
    // a cluster's: a shard's leader changed, or the stream resumed at the new one
    es.addEventListener("cluster", function (e) {
      var d = JSON.parse(e.data || "{}");
      var box = document.getElementById("cluster-notes");
      if (!box) {
        box = document.createElement("ul"); box.id = "cluster-notes"; box.setAttribute("role", "status");
        var main = document.querySelector("main");
        if (main) { main.insertBefore(box, main.firstChild); }
      }
      var li = document.createElement("li");
      li.textContent = new Date().toISOString().slice(11, 19) + " " + d.text;
      if (d.resumed !== undefined) { li.className = "resumed"; li.dataset.shard = String(d.resumed); }
      box.insertBefore(li, box.firstChild);
      while (box.children.length > 5) { box.removeChild(box.lastChild); }
      schedule("changed");
    });
    es.addEventListener("gone", function (e) {
      setLive(false);
      var d = JSON.parse(e.data || "{}");
      // the login's key was revoked: no reconnecting, back to the sign-in form
      if (d.signedOut) { es.close(); body.dataset.signedOut = "yes"; window.location.reload(); }
    });
    es.onerror = function () { setLive(false); };
  }

  countdown();
  setLive(false);
  drawTrends(document);
  connect();
})();
