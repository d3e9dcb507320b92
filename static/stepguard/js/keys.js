// Keyboard: j / k move through the timeline's steps, Enter opens one (its button), "/" jumps to the search box.
(function () {
  "use strict";
  function steps() { return Array.from(document.querySelectorAll("#timeline tr[id^='step-']")); }
  var current = -1;
  function focusStep(i) {
    var rows = steps();
    if (!rows.length) return;
    current = Math.max(0, Math.min(rows.length - 1, i));
    rows.forEach(function (r) { r.removeAttribute("aria-current"); });
    var row = rows[current];
    row.setAttribute("aria-current", "true");
    var opener = row.querySelector(".step-open");
    (opener || row).focus();
    row.scrollIntoView({ block: "nearest" });
  }
  document.addEventListener("keydown", function (e) {
    var t = e.target;
    if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT")) return;
    if (e.key === "j") { focusStep(current + 1); e.preventDefault(); }
    else if (e.key === "k") { focusStep(current - 1); e.preventDefault(); }
    else if (e.key === "/") {
      var search = document.querySelector("input[name='q']");
      if (search) { search.focus(); e.preventDefault(); }
      else { window.location.href = document.body.dataset.root + "?focus=search"; }  // the runs list
    }
  });
  if (new URLSearchParams(window.location.search).get("focus") === "search") {
    var box = document.querySelector("input[name='q']");
    if (box) box.focus();
  }
})();

// Runs list: "select all" and the count of selected runs for the bulk action.
document.addEventListener("change", function (e) {
  var t = e.target;
  if (!t.form || t.type !== "checkbox") return;
  var boxes = Array.from(t.form.querySelectorAll("input[name='run']"));
  if (t.hasAttribute("data-select-all")) boxes.forEach(function (b) { b.checked = t.checked; });
  var count = document.getElementById("selected-count");
  if (count) count.textContent = boxes.filter(function (b) { return b.checked; }).length;
});
