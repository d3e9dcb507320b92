// The run page: tabs, the duration waterfall, copy buttons, and live-feed reconnects.
(function () {
  "use strict";

  // Tabs: Timeline and History. Without this script both panels simply show one after the other.
  function setupTabs() {
    var list = document.querySelector("[role='tablist']");
    if (!list) return;
    var tabs = Array.from(list.querySelectorAll("[role='tab']"));
    function select(tab) {
      tabs.forEach(function (t) {
        var on = t === tab;
        t.setAttribute("aria-selected", on ? "true" : "false");
        t.tabIndex = on ? 0 : -1;
        document.getElementById(t.getAttribute("aria-controls")).hidden = !on;
      });
    }
    tabs.forEach(function (t, i) {
      t.addEventListener("click", function () { select(t); });
      t.addEventListener("keydown", function (e) {
        var step = e.key === "ArrowRight" ? 1 : e.key === "ArrowLeft" ? -1 : 0;
        if (!step) return;
        var next = tabs[(i + step + tabs.length) % tabs.length];
        select(next); next.focus(); e.preventDefault();
      });
    });
    list.hidden = false;
    select(tabs[0]);
  }

  // Waterfall: each step's bar spans its start..finish on one scale: the run's wall-clock span
  // (to now while it runs), so live steps and earlier chunks line up. The header gets an axis.
  function label(ms) {
    return ms < 1000 ? Math.round(ms) + " ms" : ms < 120000 ? (ms / 1000).toFixed(1) + " s"
      : Math.round(ms / 60000) + " min";
  }
  function layoutWaterfall() {
    var bars = Array.from(document.querySelectorAll("#timeline .bar"));
    var span = document.getElementById("run-span");
    var now = Date.now(), lo = Infinity, hi = -Infinity;
    if (span && span.dataset.start) lo = Number(span.dataset.start);
    if (span && span.dataset.end) hi = Number(span.dataset.end);
    var spans = bars.map(function (b) {
      var start = Number(b.dataset.start), end = b.dataset.end ? Number(b.dataset.end) : now;
      lo = Math.min(lo, start); hi = Math.max(hi, end);
      return [start, end];
    });
    if (!isFinite(lo)) return;
    if (!isFinite(hi) || hi <= lo) hi = Math.max(now, lo + 1);
    var total = Math.max(hi - lo, 1);
    bars.forEach(function (b, i) {
      b.style.marginLeft = (100 * (spans[i][0] - lo) / total).toFixed(2) + "%";
      b.style.width = Math.max(100 * (spans[i][1] - spans[i][0]) / total, 0.5).toFixed(2) + "%";
    });
    var axis = document.querySelector("th.waterfall .axis");
    if (axis) {
      axis.textContent = "";
      [0, 0.5, 1].forEach(function (f) {
        var tick = document.createElement("span");
        tick.className = "tick";
        tick.textContent = label(total * f);
        axis.appendChild(tick);
      });
    }
  }

  // Copy buttons carry the compact JSON they copy.
  function copy(button) {
    var text = button.dataset.copy, label = button.textContent;
    function done(ok) {
      button.textContent = ok ? "Copied" : "Copy failed";
      setTimeout(function () { button.textContent = label; }, 1500);
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { done(true); }, function () { done(false); });
    } else {
      var area = document.createElement("textarea");
      area.value = text; document.body.appendChild(area); area.select();
      try { done(document.execCommand("copy")); } finally { area.remove(); }
    }
  }
  document.addEventListener("click", function (e) {
    var button = e.target.closest && e.target.closest("button.copy");
    if (button) copy(button);
  });

  document.addEventListener("DOMContentLoaded", function () {
    setupTabs();
    layoutWaterfall();
    if (!window.htmx) return;
    var userOpened = false;
    document.addEventListener("click", function (e) {
      if (e.isTrusted && e.target.closest && e.target.closest(".step-open")) userOpened = true;
    });
    document.body.addEventListener("htmx:wsAfterMessage", function (e) {
      layoutWaterfall();
      // The header, the approvals and the actions fetch themselves again (run-header view),
      // when events came: not for each piece of a streamed answer.
      var message = e.detail && typeof e.detail.message === "string" ? e.detail.message : "";
      if (message.indexOf('id="history"') >= 0) {
        (window.stepguardFire || function (t) { document.body.dispatchEvent(new CustomEvent(t)); })("sg:run-changed");
      }
      // A step whose details are open and whose row just changed: its details again too.
      var panel = document.querySelector("#step-panel .step-body");
      var row = panel && document.getElementById("step-" + panel.dataset.seq);
      var opener = row && row.querySelector(".step-open");
      var attempts = row && row.querySelector(".num .badge") ? row.querySelector(".num .badge").textContent : "1";
      if (opener && (row.dataset.status !== panel.dataset.status || attempts !== panel.dataset.attempts)) {
        window.htmx.trigger(opener, "click");
      }
    });
    // The step whose details the panel shows is marked in the timeline.
    document.body.addEventListener("htmx:afterSwap", function (e) {
      if (!e.detail.target || e.detail.target.id !== "step-panel") return;
      var body = e.detail.target.querySelector(".step-body");
      document.querySelectorAll("#timeline tr.selected").forEach(function (r) { r.classList.remove("selected"); });
      var row = body && document.getElementById("step-" + body.dataset.seq);
      if (row) row.classList.add("selected");
      if (userOpened && window.matchMedia("(max-width: 70rem)").matches) {
        e.detail.target.scrollIntoView({ block: "start" });
      }
      userOpened = false;
    });
    // Say when the feed is down: the server marks it "live" again when a reconnect succeeds.
    // The ws extension retries after these close codes only; after others, offer a reload.
    var RETRIED = [1006, 1011, 1012, 1013];
    document.body.addEventListener("htmx:wsClose", function (e) {
      var status = document.getElementById("ws-status");
      if (!status) return;
      var code = e.detail && e.detail.event ? e.detail.event.code : 0;
      if (RETRIED.indexOf(code) >= 0) {
        status.dataset.state = "reconnecting";
        status.textContent = "connection lost, reconnecting…";
      } else {
        status.dataset.state = "closed";
        status.innerHTML = 'live updates stopped: <a href="">reload the page</a>';
      }
    });
    document.body.addEventListener("htmx:afterSwap", layoutWaterfall);
    // Live feed: when the websocket reconnects, resume after the last event and the last step
    // this page shows, so the server backfills exactly what was missed (and nothing twice).
    window.htmx.createWebSocket = function (url) {
      var items = document.querySelectorAll("#history li[id^='event-']");
      if (items.length) {
        url = url.replace(/after=\d+/, "after=" + items[items.length - 1].id.slice("event-".length));
      }
      var rows = Array.from(document.querySelectorAll("#timeline tr[id^='step-']")).map(
        function (r) { return Number(r.id.slice("step-".length)); });
      if (rows.length) {
        url = url.replace(/last=-?\d+/, "last=" + Math.max.apply(null, rows));
        url = url.replace(/rows=[\d,]*/, "rows=" + rows.join(","));
      }
      return new WebSocket(url);
    };
  });
})();
