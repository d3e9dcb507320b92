// The site-wide live feed: one websocket per page says *that* something changed; the page's
// live regions (hx-trigger="sg:changed from:body") fetch themselves again through the ordinary
// views. A region someone is typing into, or has ticked a box in, waits until they are done.
(function () {
  "use strict";
  var retry = 0, socket = null;

  // Live regions listen for these on <body>: sg:changed (an event anywhere: lists), sg:nav (the
  // approvals count or the kill switch), sg:holds (a workflow hold or the kill switch: run
  // headers), sg:run-changed (this run's feed). A region stays in the page and swaps its inside
  // (hx-select="#id > *"), so an event that lands while it is fetching queues on it, never on
  // an element that is gone.
  function fire(type) {
    document.body.dispatchEvent(new CustomEvent(type));
  }
  window.stepguardFire = fire;

  // Relative times (<time data-ago>, the `ago` filter) keep ticking, said as the server says
  // them (timeline.how_far): "41 s ago" under a minute, then the largest unit.
  var UNITS = [["year", 365 * 86400], ["month", 30 * 86400], ["week", 7 * 86400],
               ["day", 86400], ["hour", 3600], ["minute", 60]];
  function howFar(ms) {
    var s = Math.round(ms / 1000), a = Math.abs(s);
    if (a < 60) return s >= 0 ? s + " s ago" : "in " + (-s) + " s";
    for (var i = 0; i < UNITS.length; i++) {
      var n = Math.floor(a / UNITS[i][1]);
      if (n >= 1) {
        var text = n + " " + UNITS[i][0] + (n === 1 ? "" : "s");
        return s > 0 ? text + " ago" : "in " + text;
      }
    }
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("time[data-ago]").forEach(function (el) {
      var at = Date.parse(el.getAttribute("datetime"));
      if (!isNaN(at)) el.textContent = howFar(now - at);
    });
  }
  window.stepguardTick = tick;
  setInterval(tick, 5000);
  var TOPICS = {
    events: ["sg:changed"], workers: ["sg:changed"], approvals: ["sg:nav"],
    killswitch: ["sg:nav", "sg:holds"], holds: ["sg:holds"]
  };

  function indicator(state, text) {
    var el = document.getElementById("site-live");
    if (!el) return;
    el.dataset.state = state;
    el.textContent = text;
  }

  // A region with a focused field, typed text or a ticked box is not replaced under the user.
  function busy(region) {
    if (!region || !region.querySelectorAll) return false;
    if (region.contains(document.activeElement) && document.activeElement.matches("input, textarea, select")) return true;
    return Array.from(region.querySelectorAll("input, textarea")).some(function (f) {
      if (f.type === "hidden" || f.type === "radio") return false;
      if (f.type === "checkbox") return f.checked !== f.defaultChecked;
      return f.value !== f.defaultValue;
    });
  }

  document.addEventListener("htmx:beforeRequest", function (e) {
    var elt = e.detail.elt;
    var live = e.detail.requestConfig && e.detail.requestConfig.triggeringEvent;
    if (live && /^sg:/.test(live.type) && busy(elt)) {
      e.preventDefault();
      elt.dataset.stale = "1"; // refreshed when the user leaves it
    }
  });
  // A response that arrives after the user started typing is dropped too; and what the user
  // had opened (details) stays open in the fresh copy.
  var opened = [];
  document.addEventListener("htmx:beforeSwap", function (e) {
    var elt = e.detail.elt;
    var live = e.detail.requestConfig && e.detail.requestConfig.triggeringEvent;
    if (!live || !/^sg:/.test(live.type)) return;
    if (busy(elt)) {
      e.detail.shouldSwap = false;
      elt.dataset.stale = "1";
      return;
    }
    opened = Array.from(elt.querySelectorAll("details[open][id]")).map(function (d) { return d.id; });
  });
  // The other parts of a refresh (hx-select-oob) are guarded alike, one by one.
  document.addEventListener("htmx:oobBeforeSwap", function (e) {
    var target = e.detail.target;
    if (!target || !target.id || target.tagName === "TR") return; // timeline rows: never typed in
    if (busy(target)) {
      e.detail.shouldSwap = false;
      target.dataset.stale = "1";
      return;
    }
    target.querySelectorAll("details[open][id]").forEach(function (d) { opened.push(d.id); });
  });
  document.addEventListener("htmx:afterSettle", function () {
    opened.forEach(function (id) {
      var d = document.getElementById(id);
      if (d) d.open = true;
    });
    opened = [];
  });
  document.addEventListener("focusout", function (e) {
    var region = e.target.closest && e.target.closest("[data-stale]");
    if (!region) return;
    setTimeout(function () {
      if (!busy(region)) {
        delete region.dataset.stale;
        ["sg:changed", "sg:nav", "sg:holds", "sg:run-changed"].forEach(fire);
      }
    }, 300);
  });

  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var topics = document.querySelector("[data-live-workers]") ? "?workers=1" : "";
    // Under the path the pages are mounted at (runs.routing), as every page's body says.
    socket = new WebSocket(scheme + location.host + document.body.dataset.root + "ws/live/" + topics);
    socket.onopen = function () { retry = 0; };
    socket.onmessage = function (m) {
      var data = {};
      try { data = JSON.parse(m.data); } catch (err) { return; }
      if (data.live) indicator("open", "live");
      if (data.changed) {
        var types = {};
        data.changed.forEach(function (topic) {
          (TOPICS[topic] || []).forEach(function (t) { types[t] = true; });
        });
        Object.keys(types).forEach(fire);
      }
    };
    socket.onclose = function (e) {
      if (e.code === 4401 || e.code === 1000) { indicator("closed", "offline: reload"); return; }
      indicator("reconnecting", "reconnecting…");
      retry = Math.min(retry + 1, 6);
      setTimeout(connect, Math.random() * 1000 * Math.pow(2, retry));
    };
  }
  document.addEventListener("DOMContentLoaded", function () {
    if (window.WebSocket && document.getElementById("site-live")) connect();
    // The start-run form: its input must be JSON before it is sent.
    document.querySelectorAll("textarea[data-json]").forEach(function (area) {
      function check() {
        var text = area.value.trim();
        try { if (text) JSON.parse(text); area.setCustomValidity(""); }
        catch (err) { area.setCustomValidity("The input is not JSON: " + err.message); }
      }
      area.addEventListener("input", check);
      if (area.form) area.form.addEventListener("submit", function (e) {
        check();
        if (!area.checkValidity()) { area.reportValidity(); e.preventDefault(); }
      });
    });
  });
})();
